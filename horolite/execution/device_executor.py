"""Runs the agreed responses whose tensors live on the GPU (device "cuda").

The host Executor hands every batch with a device response here. A fused batch
costs a fixed number of CUDA calls whatever its size, none per member: one wait
per caller stream, one table upload and one gather launch to pack the members
(prescale fused, core/device_kernels.py), one allocation for the results, the
NCCL call, and the results are views of that one buffer (device_layout.py); an
allgather adds one unpack launch. A single tensor is reduced out of place, from
its input straight into its result. Everything is enqueued on the NCCL
transport's stream, and handles complete only after that stream has finished.
"""
from __future__ import annotations

import sys
import time
from operator import attrgetter
from typing import List, Optional

import numpy as np

from ..errors import HorovodInternalError
from ..core import device_kernels as kernels
from ..core.device import last_ready
from ..core.handle import Handle
from ..core.messages import Kind, Response
from ..core.ops import ReduceOp, dtype_from_name
from ..coordination.tensor_queue import Entry
from .device_layout import Gathered, Packed, Scattered, copy_unit

__all__ = ["DeviceExecutor"]

_DATA, _POINTER, _READY = attrgetter("data"), attrgetter("array.data.ptr"), attrgetter("ready")


class _Tables:
    """Kernel tables to the device: written into one pinned host buffer, one async copy
    each. Reused from batch to batch (each batch ends with a stream synchronize)."""

    def __init__(self, cupy):
        self._cupy = cupy
        self._host = self._dev = None
        self._used = 0
        self._retired = []  # buffers outgrown during this batch: copies may still read them

    def reset(self) -> None:
        self._used = 0
        self._retired.clear()

    def put(self, table: np.ndarray, stream) -> int:
        """Device address of a copy of `table` (int64), enqueued on `stream`."""
        cp, n = self._cupy, table.size
        if self._host is None or self._used + n > self._host.size:
            if self._host is not None:
                self._retired.append((self._host, self._dev))
            import cupyx
            capacity = max(1 << 12, 2 * (self._used + n))
            self._host = cupyx.empty_pinned(capacity, np.int64)
            self._dev = cp.empty(capacity, np.int64)
            self._used = 0
        lo = self._used
        self._host[lo:lo + n] = table
        cp.cuda.runtime.memcpyAsync(self._dev.data.ptr + lo * 8, self._host.ctypes.data + lo * 8,
                                    n * 8, cp.cuda.runtime.memcpyHostToDevice, stream.ptr)
        self._used += n
        return self._dev.data.ptr + lo * 8


class _Held:
    """A fused batch's result buffer and views, handed out again once nothing refers to
    any of them (as the host path's output pool): making a CuPy view costs about a
    microsecond, a step's worth of them as much as the rest of the batch."""
    __slots__ = ("buf", "views", "_counts")

    def __init__(self, buf, views: list):
        self.buf, self.views = buf, tuple(views)
        self._counts = None

    def mark(self) -> None:
        """Take the counts now, when only this object refers to the views."""
        self._counts = self._now()

    def _now(self):
        count = sys.getrefcount
        return list(map(count, self.views)), list(map(count, map(_DATA, self.views)))

    def free(self) -> bool:
        return self._now() == self._counts


class DeviceExecutor:
    def __init__(self, transport, fusion_threshold: int):
        import cupy
        self._cupy = cupy
        self.transport = transport
        self.rank = transport.rank
        self.size = transport.size
        self.device_id = transport.device_id
        self.fusion_threshold = fusion_threshold
        self._tables = _Tables(cupy)
        self._layouts = {}  # see _layout
        self._held = {}  # id(layout) -> _Held: a fused allreduce's last results
        self.launches = 0  # gather launches so far (tests and benchmarks read it)

    def run(self, host, batch: List[Response], entries: List[Optional[Entry]]) -> None:
        """Run one batch; `host` is the Executor (completion, timeline spans)."""
        first = batch[0]
        try:
            with self.transport.activate() as stream:
                self._tables.reset()
                readies = (map(_READY, entries) if not first.joined else
                           (e.ready for e in entries if e is not None))
                for event in last_ready(readies):
                    stream.wait_event(event)  # the caller's stream had produced the inputs
                if first.kind == Kind.ALLREDUCE:
                    results = self._allreduce(host, batch, entries)
                elif first.kind == Kind.ALLGATHER:
                    results = self._allgather(host, batch, entries)
                elif first.kind == Kind.BROADCAST:
                    results = self._broadcast(host, batch, entries)
                elif first.kind == Kind.REDUCESCATTER:
                    results = self._reducescatter(host, batch, entries)
                elif first.kind == Kind.ALLTOALL:
                    results = [self._alltoall(host, first, entries[0])]
                else:
                    raise HorovodInternalError(f"tensor '{first.name}': {first.kind.label} has no "
                                               "device implementation")
                self.transport.finish()  # results are complete before any handle says so
        except HorovodInternalError:
            raise
        except Exception as exc:  # CUDA or NCCL error: fail these tensors, keep the runtime
            names = ", ".join(f"'{r.name}'" for r in batch)
            raise HorovodInternalError(f"tensor {names}: {first.kind.label} on cuda:"
                                       f"{self.device_id} failed on rank {self.rank}: "
                                       f"{type(exc).__name__}: {exc}") from exc
        if first.joined or first.kind in (Kind.ALLGATHER, Kind.ALLTOALL):
            for resp, entry, value in zip(batch, entries, results):
                host.complete(resp, entry, value)
            return
        host.queue.finish_all([r.name for r in batch])
        Handle.set_results([e.handle for e in entries], results)

    # ---- the CUDA calls (one each per batch) ----
    def _alloc(self, nbytes: int):
        """One device buffer of `nbytes` bytes (uint8), on the stream (CuPy's pool)."""
        return self._cupy.empty(nbytes, dtype=self._cupy.uint8)

    def _launch(self, name: str, table: np.ndarray, dst_ptr: int, total_bytes: int, unit: int,
                factor: Optional[float] = None) -> None:
        """One gather launch: the members of `table` into the buffer at `dst_ptr`."""
        if total_bytes == 0:
            return
        stream = self.transport.stream
        args = (np.uint64(self._tables.put(table, stream)), np.int32(len(table) // 3),
                np.uint64(dst_ptr))
        if factor is not None:
            args += (np.float64(factor),)
        kernels.function(name, self.device_id)(
            (kernels.blocks_for(total_bytes // unit),), (kernels.THREADS,), args, stream=stream)
        self.launches += 1

    # ---- helpers ----
    def _layout(self, batch: List[Response], make):
        """make(batch), remembered for the last few batches: cached responses come back as
        the same objects every step, and a layout costs per member."""
        key = tuple(map(id, batch))
        hit = self._layouts.get(key)
        if hit is not None and hit[0] == batch:
            return hit[1]
        layout = make(batch)
        if len(self._layouts) >= 16:
            _, old = self._layouts.pop(next(iter(self._layouts)))
            self._held.pop(id(old), None)
        self._layouts[key] = (list(batch), layout)
        return layout

    @staticmethod
    def _pointers(entries: List[Optional[Entry]], joined=()) -> np.ndarray:
        """Each input's device address; 0 for a joined rank's missing tensor (zeros)."""
        ptrs = map(_POINTER, entries) if not joined else \
            (0 if e is None else e.array.data.ptr for e in entries)
        return np.fromiter(ptrs, dtype=np.uint64, count=len(entries))

    def _pack(self, layout: Packed, ptrs: np.ndarray, dst_ptr: int, prescale: float) -> None:
        if prescale == 1.0:
            unit = copy_unit(ptrs, layout.nbytes)
            self._launch(kernels.copy_kernel(unit), layout.table(ptrs, unit), dst_ptr,
                         layout.total, unit)
        else:
            dtype = layout.single_dtype
            self._launch(kernels.scale_kernel(dtype.name), layout.table(ptrs, dtype.itemsize),
                         dst_ptr, layout.total, dtype.itemsize, prescale)

    # ---- collectives ----
    def _allreduce(self, host, batch: List[Response], entries: List[Optional[Entry]]) -> list:
        first = batch[0]
        op = ReduceOp(first.op)
        postscale = first.total_postscale(self.size)
        names = [r.name for r in batch] if host.timeline.enabled else []
        start = host._queue_spans(batch, entries)
        layout = self._layout(batch, lambda b: Packed([r.shape for r in b],
                                                      [dtype_from_name(b[0].dtype)] * len(b)))
        entry = entries[0]
        if len(batch) == 1 and entry is not None and first.prescale == 1.0:
            # out of place: from the input straight into the result
            out = self._alloc(layout.total)
            self.transport.enqueue_allreduce(entry.array.reshape(-1), out.view(layout.single_dtype),
                                             op, postscale)
            host._span(names, "NCCL_ALLREDUCE", start, time.monotonic())
            return layout.views(out)
        held = self._held.get(id(layout))
        if held is not None and held.free():  # last time's results are all dropped
            out = held.buf
        else:
            out = self._alloc(layout.total)
        typed = out.view(layout.single_dtype)
        self._pack(layout, self._pointers(entries, first.joined), out.data.ptr, first.prescale)
        t1 = time.monotonic()
        host._span(names, "MEMCPY_IN_FUSION_BUFFER", start, t1)
        self.transport.enqueue_allreduce(typed, typed, op, postscale)
        host._span(names, "NCCL_ALLREDUCE", t1, time.monotonic())
        if held is not None and held.buf is out:
            return list(held.views)
        held = self._held[id(layout)] = _Held(out, layout.views(out))
        held.mark()
        return list(held.views)

    def _broadcast(self, host, batch: List[Response], entries: List[Optional[Entry]]) -> list:
        first = batch[0]
        start = host._queue_spans(batch, entries)
        layout = self._layout(batch, lambda b: Packed([r.shape for r in b],
                                                      [dtype_from_name(r.dtype) for r in b]))
        out = self._alloc(layout.total)
        if self.rank == first.root:
            self._pack(layout, self._pointers(entries, first.joined), out.data.ptr, 1.0)
        self.transport.enqueue_broadcast(out, first.root)
        host._span([r.name for r in batch], "NCCL_BROADCAST", start, time.monotonic())
        return layout.views(out)

    def _allgather(self, host, batch: List[Response], entries: List[Optional[Entry]]) -> list:
        start = host._queue_spans(batch, entries)
        layout = self._layout(batch, lambda b: Gathered(
            [r.shape for r in b], [dtype_from_name(r.dtype) for r in b],
            [r.first_dims for r in b], self.rank))
        gathered = self._alloc(layout.segment * self.size)
        ptrs = self._pointers(entries, batch[0].joined)
        unit = copy_unit(ptrs, layout.pack_starts, layout.pack_bytes)
        self._launch(kernels.copy_kernel(unit), layout.pack_table(ptrs, unit),
                     gathered.data.ptr + self.rank * layout.segment, layout.segment, unit)
        self.transport.enqueue_allgather(gathered, layout.segment)
        out = self._alloc(layout.total)
        self._launch(kernels.copy_kernel(layout.unpack_unit),
                     layout.unpack_table(gathered.data.ptr), out.data.ptr, layout.total,
                     layout.unpack_unit)
        host._span([r.name for r in batch], "NCCL_ALLGATHER", start, time.monotonic())
        return layout.views(out)

    def _reducescatter(self, host, batch: List[Response], entries: List[Optional[Entry]]) -> list:
        first = batch[0]
        start = host._queue_spans(batch, entries)
        dtype = dtype_from_name(first.dtype)
        layout = self._layout(batch, lambda b: Scattered([r.shape for r in b], dtype, self.size,
                                                         self.rank))
        send = self._alloc(layout.segment * self.size)
        recv = self._alloc(layout.segment)
        src = layout.sources(self._pointers(entries, first.joined))
        if first.prescale == 1.0:
            unit = copy_unit(src, layout.piece_bytes)
            self._launch(kernels.copy_kernel(unit), layout.table(src, unit), send.data.ptr,
                         send.nbytes, unit)
        else:
            item = dtype.itemsize
            self._launch(kernels.scale_kernel(dtype.name), layout.table(src, item), send.data.ptr,
                         send.nbytes, item, first.prescale)
        self.transport.enqueue_reducescatter(send.view(dtype), recv.view(dtype), ReduceOp(first.op),
                                             first.total_postscale(self.size))
        host._span([r.name for r in batch], "NCCL_REDUCESCATTER", start, time.monotonic())
        return layout.views(recv)

    def _alltoall(self, host, resp: Response, entry: Entry):
        start = host._queue_spans([resp], [entry])
        array = entry.array
        row_shape = tuple(array.shape[1:])
        row_bytes = int(np.prod(row_shape, dtype=np.int64)) * array.itemsize
        recv, recv_rows = self.transport.alltoall(array.reshape(-1).view(self._cupy.uint8),
                                                  entry.splits, row_bytes)
        out = recv.view(array.dtype).reshape((int(recv_rows.sum()),) + row_shape)
        host._span([resp.name], "NCCL_ALLTOALL", start, time.monotonic())
        return out, recv_rows
