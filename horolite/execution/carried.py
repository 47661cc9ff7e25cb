"""Small allreduces carried in the control round, between the ranks of one host.

A tensor whose response is cached waits for the cycle whose control round says
every rank has it ready. When it is small, each rank also puts its bytes in that
round's mailbox on the control board (transport/control_board.py), every round it
waits. The round that makes it ready everywhere then holds every rank's bytes, so
each rank reduces them itself, in rank order (the same bits everywhere), and the
tensor needs no exchange of its own: one rendezvous instead of two, and a rank
does not wait for a slower peer to reach its executor. The round's vector says
which tensors each rank carried (control.py); only those every rank carried are
reduced here, the rest go through the executor as before.

Each rank reads every rank's copy, so what is carried is bounded by the bytes a
rank reads (CARRY_READ_BYTES over the ranks), not only by the mailbox.
"""
from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from ..core import kernels
from ..core.messages import Kind, Response
from ..core.ops import ReduceOp
from ..coordination.tensor_queue import Entry
from ..transport.control_board import CARRY_MAX_TENSORS

__all__ = ["Carrier", "CARRY_READ_BYTES"]

# Bytes a rank reads to reduce one carried tensor (its size x the ranks): past this
# the shared-memory allreduce, which reads each byte about twice, is cheaper.
CARRY_READ_BYTES = 128 << 10

_codes: Dict[np.dtype, Optional[int]] = {}  # dtype -> the kernels' code, None: not reducible
_OPS = frozenset(int(op) for op in (ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MIN,
                                    ReduceOp.MAX, ReduceOp.PRODUCT))


class Carrier:
    """Posts a rank's small waiting allreduces to the board and completes the carried ones."""

    def __init__(self, board, executor):
        self.board = board
        self.executor = executor
        self.limit = CARRY_READ_BYTES // board.size
        self.carried = 0  # tensors completed from the control round (tests read it)
        self.rounds = 0  # control rounds that carried any: batches, as fused_batches counts

    def eligible(self, entry: Entry) -> bool:
        """Whether a cache hit can ride in the control round: a host allreduce the
        native kernels reduce, small enough. The same answer on every rank for one
        cached response; the mailbox's room is what may differ (hence the bits)."""
        req = entry.request
        array = entry.array
        if (req.kind != Kind.ALLREDUCE or req.op not in _OPS or req.device != "cpu"
                or req.quorum or array is None or not 0 < array.nbytes <= self.limit):
            return False
        dtype = array.dtype
        if dtype not in _codes:
            try:
                _codes[dtype] = kernels.native_codes(dtype, ReduceOp.SUM)[0]
            except (TypeError, ValueError):
                _codes[dtype] = None
        if _codes[dtype] is None:
            return False
        return entry.parts is not None or array.flags.c_contiguous

    def post(self, waiting: Dict[int, Entry]) -> List[int]:
        """Post the eligible ones of the `waiting` entries (slot -> entry); the slots
        posted. Only while few wait: a step of many small tensors goes as one fused batch
        instead, which costs less than a reduce call per tensor and is not split."""
        if not waiting or len(waiting) > CARRY_MAX_TENSORS:
            return self.board.post(())
        items = []
        for slot, entry in waiting.items():
            carry = entry.carry
            if carry is None:
                carry = entry.carry = self.eligible(entry)
            if carry:
                items.append((slot, entry.parts if entry.parts is not None else (entry.array,),
                              entry.request.prescale))
        return self.board.post(items)

    def run(self, responses: Sequence[Response], entries: Sequence[Entry], slots: Sequence[int],
            timeline) -> int:
        """Reduce each carried slot's bytes from the round into its result and complete
        it; the bytes reduced."""
        reduced, complete = 0, self.executor.complete
        start = time.monotonic()
        # (counted first: a caller woken by the last completion may read them at once)
        self.carried += len(slots)
        self.rounds += 1
        for resp, entry, slot in zip(responses, entries, slots):
            codes = resp.__dict__.get("_carried")  # the cached response recurs every step
            array = entry.array
            if codes is None:
                codes = resp.__dict__["_carried"] = (
                    *kernels.native_codes(array.dtype, ReduceOp(resp.op)),
                    resp.total_postscale(self.board.size))
            out = array if entry.owned else np.empty(array.shape, array.dtype)
            self.board.reduce_carried(slot, out, *codes)
            complete(resp, entry, out)
            reduced += out.nbytes
        if timeline.enabled:
            end = time.monotonic()
            for resp in responses:
                timeline.span(resp.name, "ALLREDUCE", start, end, {"carried": True})
        return reduced
