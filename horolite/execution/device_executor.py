"""Runs the agreed responses whose tensors live on the GPU (device "cuda").

The host Executor hands every batch with a device response here; the steps
mirror its host ones (pack into the fusion buffer with the prescale, one
transport call, unpack) but every array is CuPy, every copy and kernel is
enqueued on the NCCL transport's stream, and handles complete only after that
stream has finished. The fusion buffer is one device buffer, allocated at the
first fused batch and reused.
"""
from __future__ import annotations

import time
from typing import List, Optional

import numpy as np

from ..errors import HorovodInternalError
from ..core.messages import Kind, Response
from ..core.ops import ReduceOp, dtype_from_name
from ..transport.ring import row_bounds
from ..coordination.tensor_queue import Entry
from ..transport.nccl import device_copy, device_scale

__all__ = ["DeviceExecutor"]


class DeviceExecutor:
    def __init__(self, transport, fusion_threshold: int):
        import cupy
        self._cupy = cupy
        self.transport = transport
        self.rank = transport.rank
        self.size = transport.size
        self.fusion_threshold = fusion_threshold
        self._fusion = None

    def run(self, host, batch: List[Response], entries: List[Optional[Entry]]) -> None:
        """Run one batch; `host` is the Executor (completion, timeline spans)."""
        first = batch[0]
        try:
            with self.transport.activate() as stream:
                for entry in entries:
                    ready = getattr(entry, "ready", None) if entry is not None else None
                    if ready is not None:  # the caller's stream had produced the input by then
                        stream.wait_event(ready)
                if first.kind == Kind.ALLREDUCE:
                    results = self._allreduce(host, batch, entries)
                elif first.kind == Kind.ALLGATHER:
                    results = [self._allgather(host, first, entries[0])]
                elif first.kind == Kind.BROADCAST:
                    results = [self._broadcast(host, first, entries[0])]
                elif first.kind == Kind.ALLTOALL:
                    results = [self._alltoall(host, first, entries[0])]
                elif first.kind == Kind.REDUCESCATTER:
                    results = [self._reducescatter(host, first, entries[0])]
                else:
                    raise HorovodInternalError(f"tensor '{first.name}': {first.kind.label} has no "
                                               "device implementation")
                stream.synchronize()  # results are complete before any handle says so
        except HorovodInternalError:
            raise
        except Exception as exc:  # CUDA or NCCL error: fail these tensors, keep the runtime
            names = ", ".join(f"'{r.name}'" for r in batch)
            raise HorovodInternalError(f"tensor {names}: {first.kind.label} on cuda:"
                                       f"{self.transport.device_id} failed on rank {self.rank}: "
                                       f"{type(exc).__name__}: {exc}") from exc
        for resp, entry, value in zip(batch, entries, results):
            host._complete(resp, entry, value)

    # ---- helpers ----
    def _input(self, resp: Response, entry: Optional[Entry]):
        if entry is not None:
            return entry.array
        # A joined rank contributes zeros, on the device like everyone else's tensor.
        return self._cupy.zeros(resp.shape, dtype=dtype_from_name(resp.dtype))

    def _fusion_buffer(self, nbytes: int):
        if self._fusion is None or self._fusion.nbytes < nbytes:
            self._fusion = self._cupy.empty(max(self.fusion_threshold, nbytes), dtype=self._cupy.uint8)
        return self._fusion[:nbytes]

    @staticmethod
    def _flat(array):
        return array.reshape(-1)

    # ---- collectives ----
    def _allreduce(self, host, batch: List[Response], entries: List[Optional[Entry]]) -> list:
        cp = self._cupy
        first = batch[0]
        op = ReduceOp(first.op)
        postscale = first.total_postscale(self.size)
        names = [r.name for r in batch]
        inputs = [self._input(r, e) for r, e in zip(batch, entries)]
        outputs = [cp.empty(a.shape, dtype=a.dtype) for a in inputs]
        start = host._queue_spans(batch, entries)
        if len(batch) == 1:
            flat = self._flat(outputs[0])
            device_copy(flat, self._flat(inputs[0]))
            device_scale(flat, first.prescale)
            t1 = time.monotonic()
            host._span(names, "MEMCPY_IN_FUSION_BUFFER", start, t1)
            self.transport.allreduce(flat, op, postscale)
            host._span(names, "NCCL_ALLREDUCE", t1, time.monotonic())
            return outputs
        total = sum(a.nbytes for a in inputs)
        buf = self._fusion_buffer(total)
        offset = 0
        for a in inputs:
            device_copy(buf[offset:], self._flat(a))
            offset += a.nbytes
        typed = buf.view(inputs[0].dtype)
        device_scale(typed, first.prescale)
        t1 = time.monotonic()
        host._span(names, "MEMCPY_IN_FUSION_BUFFER", start, t1)
        self.transport.allreduce(typed, op, postscale)
        t2 = time.monotonic()
        host._span(names, "NCCL_ALLREDUCE", t1, t2)
        offset = 0
        for out in outputs:
            device_copy(self._flat(out), buf[offset:], out.nbytes)
            offset += out.nbytes
        host._span(names, "MEMCPY_OUT_FUSION_BUFFER", t2, time.monotonic())
        return outputs

    def _allgather(self, host, resp: Response, entry: Entry):
        cp = self._cupy
        start = host._queue_spans([resp], [entry])
        array = entry.array
        row_bytes = int(np.prod(resp.shape[1:], dtype=np.int64)) * array.itemsize
        dims = resp.first_dims
        out = cp.empty((sum(dims),) + tuple(resp.shape[1:]), dtype=array.dtype)
        out_bytes = self._flat(out).view(cp.uint8)
        bounds = [0]
        for d in dims:
            bounds.append(bounds[-1] + d * row_bytes)
        device_copy(out_bytes[bounds[self.rank]:], self._flat(array))
        self.transport.allgather(out_bytes, bounds)
        host._span([resp.name], "NCCL_ALLGATHER", start, time.monotonic())
        return out

    def _broadcast(self, host, resp: Response, entry: Entry):
        cp = self._cupy
        start = host._queue_spans([resp], [entry])
        out = cp.empty(entry.array.shape, dtype=entry.array.dtype)
        if self.rank == resp.root:
            device_copy(self._flat(out), self._flat(entry.array))
        self.transport.broadcast(self._flat(out).view(cp.uint8), resp.root)
        host._span([resp.name], "NCCL_BROADCAST", start, time.monotonic())
        return out

    def _alltoall(self, host, resp: Response, entry: Entry):
        cp = self._cupy
        start = host._queue_spans([resp], [entry])
        array = entry.array
        row_shape = tuple(array.shape[1:])
        row_bytes = int(np.prod(row_shape, dtype=np.int64)) * array.itemsize
        recv, recv_rows = self.transport.alltoall(self._flat(array).view(cp.uint8), entry.splits,
                                                  row_bytes)
        out = recv.view(array.dtype).reshape((int(recv_rows.sum()),) + row_shape)
        host._span([resp.name], "NCCL_ALLTOALL", start, time.monotonic())
        return out, recv_rows

    def _reducescatter(self, host, resp: Response, entry: Entry):
        cp = self._cupy
        start = host._queue_spans([resp], [entry])
        array = entry.array
        op = ReduceOp(resp.op)
        postscale = resp.total_postscale(self.size)
        work = cp.empty(array.size, dtype=array.dtype)
        device_copy(work, self._flat(array))
        device_scale(work, resp.prescale)
        rows = array.shape[0]
        row_elems = int(np.prod(array.shape[1:], dtype=np.int64))
        bounds = row_bounds(rows, row_elems, self.size)
        self.transport.reducescatter(work, bounds, op, postscale)
        base, extra = divmod(rows, self.size)
        my_rows = base + (1 if self.rank < extra else 0)
        mine = work[bounds[self.rank]:bounds[self.rank + 1]]
        out = cp.empty((my_rows,) + tuple(array.shape[1:]), dtype=array.dtype)
        device_copy(self._flat(out), mine)
        host._span([resp.name], "NCCL_REDUCESCATTER", start, time.monotonic())
        return out
