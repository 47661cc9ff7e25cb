"""Runs the agreed responses: fuse, call the transport, complete the handles.

Every rank calls `run` with the same response list, so every rank makes the
same transport calls in the same order.
"""
from __future__ import annotations

import logging
import math
import time
from functools import lru_cache
from typing import List, Optional, Sequence

import numpy as np

from ..core import kernels
from ..errors import HorovodInternalError, InvalidCollectiveError, StallError, TensorMismatchError
from .adasum import run_adasum
from .fusion import plan_spans
from .output_pool import OutputPool
from ..core.handle import Handle
from ..core.messages import Kind, Response
from ..core.ops import ReduceOp, dtype_from_name
from ..coordination.quorum import QuorumExecutor
from ..transport.ring import row_bounds
from ..coordination.tensor_queue import Entry, TensorQueue

__all__ = ["Executor"]

_log = logging.getLogger("horolite.execution.executor")


@lru_cache(maxsize=None)
def _dtype(name: str) -> np.dtype:
    return dtype_from_name(name)


def _nbytes(resp: Response) -> int:
    # Cached on the response: cached responses come back every step, and this is
    # asked per tensor per cycle (fusion planning, autotune's byte count).
    nbytes = resp.__dict__.get("_nbytes")
    if nbytes is None:
        nbytes = resp.__dict__["_nbytes"] = math.prod(resp.shape) * _dtype(resp.dtype).itemsize
    return nbytes


class _FusedLayout:
    """Where each tensor of a fused allreduce sits in the fusion buffer. Made once per
    batch of cached responses, which recur as the same objects every step."""
    __slots__ = ("size", "names", "_rows", "_pieces")

    def __init__(self, batch: Sequence[Response]):
        shapes = [tuple(r.shape) for r in batch]
        counts = [math.prod(shape) for shape in shapes]
        self.size = sum(counts)
        self.names = [r.name for r in batch]
        self._rows = self._pieces = None
        if len(set(shapes)) == 1 and shapes[0]:
            self._rows = (len(shapes),) + shapes[0]  # one reshape; its rows are the results
        else:
            pieces, offset = [], 0
            for shape, n in zip(shapes, counts):
                pieces.append((slice(offset, offset + n), None if len(shape) == 1 else shape))
                offset += n
            self._pieces = pieces

    def views(self, flat: np.ndarray) -> List[np.ndarray]:
        """Each tensor's piece of the reduced buffer, shaped like the tensor."""
        if self._rows is not None:
            return list(flat.reshape(self._rows))
        return [flat[piece] if shape is None else flat[piece].reshape(shape)
                for piece, shape in self._pieces]


def _error_for(resp: Response) -> HorovodInternalError:
    if resp.error_type == "abandoned":  # a peer's step failed there: a runtime failure
        error = HorovodInternalError(resp.error)  # naming it, as a peer's notice does
        error.horolite_peer = resp.peer
        return error
    cls = TensorMismatchError if resp.error_type == "mismatch" else InvalidCollectiveError
    return cls(resp.error)


class Executor:
    def __init__(self, transport, queue: TensorQueue, fusion_threshold: int, timeline):
        self.transport = transport
        self.queue = queue
        self.rank = transport.rank
        self.size = transport.size
        self.fusion_threshold = fusion_threshold
        self.fused_batches = 0  # allreduces of several tensors in one buffer (tests read it)
        self.fused_tensors = 0  # the tensors in them: with fused_batches, tensors per batch
        shared = getattr(transport, "shared_memory", None)
        self.outputs = OutputPool(shared.arena if shared is not None else None)
        self._plans = {}  # see _plan
        self.timeline = timeline
        # GPU path: a device_execution.DeviceExecutor, set by the runtime when NCCL is up.
        self.device = None
        self.quorum = QuorumExecutor(transport, queue)

    # ---- entry points ----
    def set_fusion_threshold(self, threshold: int) -> None:
        """Rank 0's value, adopted by every rank at the same cycle."""
        self.fusion_threshold = threshold

    def run(self, responses: Sequence[Response], entries: Sequence[Optional[Entry]],
            threshold: Optional[int] = None, batch_done=None) -> int:
        """Execute the responses in order; returns the bytes allreduced (autotune's measure).
        threshold: the fusion threshold of the cycle that agreed the list (default: the
        current one), for a list run after this rank adopted another (execution/lane.py);
        batch_done(n): called as each batch of n responses ends."""
        reduced = 0
        plan = self._plan(responses, self.fusion_threshold if threshold is None else threshold)
        for lo, hi, layout in plan:
            batch, batch_entries = responses[lo:hi], entries[lo:hi]
            first = batch[0]
            self.transport.doing(f"tensor '{first.name}'" if hi - lo == 1 else
                                 f"tensor '{first.name}' and {hi - lo - 1} more fused with it")
            try:
                if first.contributors:
                    self.quorum.run(first, batch_entries[0],
                                    _error_for(first) if first.error is not None else None)
                elif first.error is not None:
                    self.complete(first, batch_entries[0], error=_error_for(first))
                elif first.device != "cpu":
                    self._run_device(batch, batch_entries)
                elif first.kind == Kind.ALLREDUCE and first.op == ReduceOp.ADASUM:
                    reduced += run_adasum(self, batch, batch_entries)
                elif first.kind == Kind.ALLREDUCE:
                    reduced += self._allreduce(batch, batch_entries, layout)
                elif first.kind == Kind.ALLGATHER:
                    self._allgather(first, batch_entries[0])
                elif first.kind == Kind.BROADCAST:
                    self._broadcast(first, batch_entries[0])
                elif first.kind == Kind.ALLTOALL:
                    self._alltoall(first, batch_entries[0])
                elif first.kind == Kind.REDUCESCATTER:
                    self._reducescatter(first, batch_entries[0])
                elif first.kind == Kind.BARRIER:
                    self.complete(first, batch_entries[0], None)
                elif first.kind == Kind.JOIN:
                    self.complete(first, batch_entries[0], first.last_joined)
                else:
                    raise HorovodInternalError(f"unknown collective {first.kind!r}")
            except StallError:
                raise  # a peer stopped answering: the whole runtime ends (runtime._loop)
            except HorovodInternalError as e:
                for resp, entry in zip(batch, batch_entries):
                    self.complete(resp, entry, error=e)
            if batch_done is not None:
                batch_done(hi - lo)
        return reduced

    def _plan(self, responses: Sequence[Response], threshold: int):
        """[(start, stop, layout)]: plan_spans with `threshold`, with the layout of each
        fused host allreduce, remembered for the last few response lists: cached responses
        come back as the same objects every step, and planning costs per tensor."""
        key = (threshold, tuple(map(id, responses)))
        hit = self._plans.get(key)
        current = tuple(responses)
        if hit is not None and hit[0] == current:  # identical objects: same plan
            return hit[1]
        plan = []
        for lo, hi in plan_spans(current, _nbytes, threshold):
            first = current[lo]
            fused = (hi - lo > 1 and first.kind == Kind.ALLREDUCE and first.error is None
                     and first.device == "cpu")
            plan.append((lo, hi, _FusedLayout(current[lo:hi]) if fused else None))
        if len(self._plans) >= 8:
            self._plans.pop(next(iter(self._plans)))
        self._plans[key] = (current, plan)
        return plan

    def _run_device(self, batch: List[Response], entries: List[Optional[Entry]]) -> None:
        """Tensors in GPU memory go to the NCCL side (device_execution.py)."""
        if self.device is None:
            raise InvalidCollectiveError(f"tensor '{batch[0].name}' is on {batch[0].device} but rank "
                                         f"{self.rank} has no NCCL transport")
        self.device.run(self, batch, entries)

    # ---- completion ----
    def complete(self, resp: Response, entry: Optional[Entry], value=None, error=None) -> None:
        if entry is None:  # a joined rank's zero contribution: nobody waits for it
            return
        self.queue.finish(resp.name)
        if resp.first_dims is not None:
            entry.handle.first_dims = resp.first_dims
        if error is not None:
            entry.handle._set_exception(error)
        else:
            entry.handle._set_result(value)

    def _span(self, names: List[str], phase: str, start: float, end: float) -> None:
        if self.timeline.enabled:
            for name in names:
                self.timeline.span(name, phase, start, end)

    def _queue_spans(self, batch: Sequence[Response], entries: Sequence[Optional[Entry]]) -> float:
        now = time.monotonic()
        if self.timeline.enabled:
            for resp, entry in zip(batch, entries):
                if entry is not None:
                    self.timeline.span(resp.name, "QUEUE", entry.responded, now)
        return now

    def _input(self, resp: Response, entry: Optional[Entry]) -> np.ndarray:
        if entry is not None:
            return entry.array
        return np.zeros(resp.shape, dtype=_dtype(resp.dtype))

    # ---- collectives ----
    def _allreduce(self, batch: List[Response], entries: List[Optional[Entry]],
                   layout: Optional[_FusedLayout] = None) -> int:
        """Returns the bytes reduced."""
        first = batch[0]
        op = ReduceOp(first.op)
        postscale = first.total_postscale(self.size)
        names = [r.name for r in batch] if self.timeline.enabled else []
        inputs = [e.array if e is not None else self._input(r, e) for r, e in zip(batch, entries)]
        start = self._queue_spans(batch, entries)
        if len(batch) > 1:
            # (an unpacked group's array is still empty: its parts are its input)
            members = []
            for entry, array in zip(entries, inputs):
                if entry is not None and entry.parts is not None:
                    members += entry.parts
                else:
                    members.append(array.reshape(-1))
            self.fused_batches += 1
            self.fused_tensors += len(batch)
            # One result array for the batch, reduced in place; each tensor's result is a
            # view of it (from the pool: reused once every view is gone).
            layout = layout or _FusedLayout(batch)
            flat = self.outputs.empty((layout.size,), inputs[0].dtype)
            what = f"tensor '{first.name}' and {len(batch) - 1} more fused with it"
            if first.prescale == 1.0 and self.transport.reads_parts and flat.size:
                # Through shared memory the members are read where they lie: no pack
                # pass over the bytes (the other paths reduce a packed buffer in place).
                self.transport.allreduce_parts(members, flat, op, postscale, what)
                self._span(names, "ALLREDUCE", start, time.monotonic())
            else:
                kernels.pack_into(flat, members, first.prescale)
                t1 = time.monotonic()
                self._span(names, "MEMCPY_IN_FUSION_BUFFER", start, t1)
                self.transport.allreduce(flat, op, postscale, what)
                self._span(names, "ALLREDUCE", t1, time.monotonic())
            if not first.joined:
                self.queue.finish_all(layout.names)
                Handle.set_results([e.handle for e in entries], layout.views(flat))
            else:  # this rank's zeros stand in for tensors it does not have: nobody waits
                done = [(r.name, e.handle, v) for r, e, v in zip(batch, entries, layout.views(flat))
                        if e is not None]
                self.queue.finish_all([name for name, _, _ in done])
                Handle.set_results([h for _, h, _ in done], [v for _, _, v in done])
            return flat.nbytes
        entry = entries[0]
        if entry is not None and entry.owned and first.prescale == 1.0:
            # A group in the output pool: reduced into it, it is the result. Its members
            # read where they lie, or packed there (then in place: through shared memory,
            # with every rank in place, nothing is staged).
            out = entry.array
            if entry.parts is not None:
                self.transport.allreduce_parts(entry.parts, out.reshape(-1), op, postscale,
                                               f"tensor '{first.name}'")
            else:
                self.transport.allreduce(out.reshape(-1), op, postscale, f"tensor '{first.name}'")
            self._span(names, "ALLREDUCE", start, time.monotonic())
            self.complete(first, entry, out)
            return out.nbytes
        outputs = [self.outputs.empty(inputs[0].shape, inputs[0].dtype)]
        if first.prescale == 1.0:
            # No copy into the output first: the ring reads the input and writes the output.
            self.transport.allreduce_from(inputs[0].reshape(-1), outputs[0].reshape(-1), op,
                                          postscale, f"tensor '{first.name}'")
            self._span(names, "ALLREDUCE", start, time.monotonic())
        else:
            flat = outputs[0].reshape(-1)
            kernels.pack(flat.view(np.uint8), inputs, first.prescale)
            t1 = time.monotonic()
            self._span(names, "MEMCPY_IN_FUSION_BUFFER", start, t1)
            self.transport.allreduce(flat, op, postscale, f"tensor '{first.name}'")
            self._span(names, "ALLREDUCE", t1, time.monotonic())
        self.complete(first, entries[0], outputs[0])
        return outputs[0].nbytes

    def _allgather(self, resp: Response, entry: Entry) -> None:
        start = self._queue_spans([resp], [entry])
        array = entry.array
        row_bytes = int(np.prod(resp.shape[1:], dtype=np.int64)) * array.itemsize
        dims = resp.first_dims
        out = np.empty((sum(dims),) + tuple(resp.shape[1:]), dtype=array.dtype)
        out_bytes = out.reshape(-1).view(np.uint8)
        bounds = [0]
        for d in dims:
            bounds.append(bounds[-1] + d * row_bytes)
        out_bytes[bounds[self.rank]:bounds[self.rank + 1]] = array.reshape(-1).view(np.uint8)
        self.transport.allgather(out_bytes, bounds)
        self._span([resp.name], "ALLGATHER", start, time.monotonic())
        self.complete(resp, entry, out)

    def _broadcast(self, resp: Response, entry: Entry) -> None:
        start = self._queue_spans([resp], [entry])
        if self.rank == resp.root:
            out = entry.array.copy()
        else:
            out = np.empty(entry.array.shape, dtype=entry.array.dtype)
        self.transport.broadcast(out.reshape(-1).view(np.uint8), resp.root)
        self._span([resp.name], "BROADCAST", start, time.monotonic())
        self.complete(resp, entry, out)

    def _alltoall(self, resp: Response, entry: Entry) -> None:
        start = self._queue_spans([resp], [entry])
        array = entry.array
        row_shape = tuple(array.shape[1:])
        row_bytes = int(np.prod(row_shape, dtype=np.int64)) * array.itemsize
        recv, recv_rows = self.transport.alltoall(array.reshape(-1).view(np.uint8),
                                                  entry.splits, row_bytes)
        out = recv.view(array.dtype).reshape((int(recv_rows.sum()),) + row_shape)
        self._span([resp.name], "ALLTOALL", start, time.monotonic())
        self.complete(resp, entry, (out, recv_rows))

    def _reducescatter(self, resp: Response, entry: Entry) -> None:
        start = self._queue_spans([resp], [entry])
        array = entry.array
        op = ReduceOp(resp.op)
        postscale = resp.total_postscale(self.size)
        work = np.empty(array.size, dtype=array.dtype)
        kernels.pack(work.view(np.uint8), [array], resp.prescale)
        rows = array.shape[0] if array.ndim else 1
        row_elems = int(np.prod(array.shape[1:], dtype=np.int64)) if array.ndim else 1
        bounds = row_bounds(rows, row_elems, self.size)
        self.transport.reducescatter(work, bounds, op, postscale)
        mine = work[bounds[self.rank]:bounds[self.rank + 1]]
        my_rows = (bounds[self.rank + 1] - bounds[self.rank]) // row_elems if row_elems else 0
        if row_elems == 0:
            base, extra = divmod(rows, self.size)
            my_rows = base + (1 if self.rank < extra else 0)
        out = mine.copy().reshape((my_rows,) + tuple(array.shape[1:]))
        self._span([resp.name], "REDUCESCATTER", start, time.monotonic())
        self.complete(resp, entry, out)
