"""The quorum allreduce: done once k of the n ranks have submitted.

What SyncReplicasOptimizer's backup workers need: a step must not wait for
the slowest ranks. Rank 0 decides as for any tensor, but as soon as k
non-joined ranks have submitted; the first k to reach it (by cycle, then by
rank) are the *contributors*, and the response names them, so every rank
knows the same set. Every rank takes part in the exchange, as with join():
a rank outside the quorum adds zeros. A rank whose request was not yet part
of the decision keeps the result, and its own later submission of that name
is answered with it, oldest first, without any exchange: each rank's n-th
submission of a name gets the name's n-th decision.

Only Sum and Average (over the k contributors) are defined: zeros from the
late ranks would change a Min, Max or Product.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Dict, Iterable, Optional, Sequence

import numpy as np

from ..core import kernels
from ..errors import HorovodInternalError, InvalidCollectiveError, TensorMismatchError
from ..core.messages import Request, Response
from ..core.ops import ReduceOp, dtype_from_name

__all__ = ["check_quorum", "needed", "decide", "QuorumExecutor"]

_log = logging.getLogger("horolite")

# A rank that took part in a quorum allreduce this recently keeps its background
# thread cycling even with nothing of its own in flight: the next decision may be
# made without it, but never without its cycle.
ACTIVE_SECONDS = 2.0


def check_quorum(quorum, op: ReduceOp, name: str, size: int) -> int:
    """The request's quorum field for a user's `quorum` argument (None: 0, all ranks)."""
    if quorum is None:
        return 0
    if isinstance(quorum, bool) or not isinstance(quorum, (int, np.integer)) or \
            not 1 <= int(quorum) <= size:
        raise InvalidCollectiveError(
            f"tensor '{name}': quorum must be an integer from 1 to {size} (the number of "
            f"ranks), got {quorum!r}")
    if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise InvalidCollectiveError(
            f"tensor '{name}': a quorum allreduce supports Average and Sum, not "
            f"{ReduceOp(op).name.capitalize()} (the ranks outside the quorum add zeros)")
    return int(quorum)


# ---- rank 0: deciding ----

def needed(request: Request, expected: int) -> int:
    """How many non-joined ranks must have submitted before the tensor is decided."""
    return min(request.quorum, expected) if request.quorum else expected


def decide(response: Response, arrived: Sequence[int], joined: Iterable[int], count: int) -> Response:
    """Name the contributors (the first `count` non-joined ranks of `arrived`, which is
    in arrival order) and the ranks present in the decision on the response."""
    joined = set(joined)
    response.contributors = tuple(sorted([r for r in arrived if r not in joined][:count]))
    response.present = tuple(sorted(arrived))
    return response


# ---- every rank: executing ----

class QuorumExecutor:
    """Runs quorum responses on the background thread, and keeps the results of the
    decisions this rank was late for until it submits."""

    def __init__(self, transport, queue):
        self.transport = transport
        self.queue = queue
        self.rank = transport.rank
        # name -> deque of (response, result, error), oldest decision first
        self._late: Dict[str, deque] = {}
        self._last_run = float("-inf")

    def active(self, now: float) -> bool:
        """Whether quorum allreduces ran lately (then this rank must not idle: see ACTIVE_SECONDS)."""
        return now - self._last_run < ACTIVE_SECONDS

    def run(self, resp: Response, entry, error: Optional[BaseException]) -> None:
        """Take part in one quorum allreduce (every rank calls this for it)."""
        self._last_run = time.monotonic()
        if self.rank not in resp.present:
            entry = None  # a submission that may be queued here belongs to this decision's result
        value = None
        if error is None:
            try:
                value = self._reduce(resp, entry)
            except HorovodInternalError as e:
                error = e
        if entry is not None:
            self._complete(entry, resp, value, error)
        elif self.rank not in resp.joined:
            self._late.setdefault(resp.name, deque()).append((resp, value, error))

    def _reduce(self, resp: Response, entry) -> np.ndarray:
        dtype = dtype_from_name(resp.dtype)
        mine = entry is not None and self.rank in resp.contributors
        work = np.empty(resp.shape, dtype=dtype)
        flat = work.reshape(-1)
        if mine:
            kernels.pack(flat.view(np.uint8), [entry.array], resp.prescale)
        else:
            flat[...] = 0
        postscale = resp.postscale
        if resp.op == ReduceOp.AVERAGE:
            postscale /= len(resp.contributors)
        self.transport.allreduce(flat, ReduceOp.SUM, postscale,
                                 f"tensor '{resp.name}' (quorum of {len(resp.contributors)})")
        return work

    def answer(self, entry) -> bool:
        """Complete a submission at once from a decision already made without it; False
        when there is none (the submission then goes to rank 0 as usual)."""
        req = entry.request
        pending = self._late.get(req.name)
        if not pending:
            return False
        resp, value, error = pending.popleft()
        if not pending:
            del self._late[req.name]
        if error is None and (req.dtype, tuple(req.shape), req.op) != \
                (resp.dtype, tuple(resp.shape), resp.op):
            error = TensorMismatchError(
                f"tensor '{req.name}': rank {self.rank} submitted {req.dtype} {tuple(req.shape)} "
                f"with op {ReduceOp(req.op).name.capitalize()} after the quorum of ranks "
                f"{', '.join(map(str, resp.contributors))} had reduced it as {resp.dtype} "
                f"{tuple(resp.shape)} with op {ReduceOp(resp.op).name.capitalize()}")
        _log.debug("rank %d: tensor '%s' answered from the quorum of ranks %s", self.rank,
                   req.name, resp.contributors)
        self._complete(entry, resp, value, error)
        return True

    def _complete(self, entry, resp: Response, value, error) -> None:
        self.queue.finish(entry.request.name)
        entry.handle.contributors = resp.contributors
        if error is not None:
            entry.handle._set_exception(error)
        else:
            entry.handle._set_result(value)
