"""The bandwidth-optimal ring over point-to-point messages.

Allreduce is a scatter-reduce (n-1 steps) then an allgather (n-1 steps); each
rank sends and receives about 2(n-1)/n of the buffer, whatever n is. The
segment schedule is chosen so that after the scatter-reduce rank r owns
segment r, which makes reducescatter the first half of allreduce and
allgather the second half.

Every step is cut into pieces, and the steps run as one pipeline: the piece a
rank receives in step s is what it sends in step s+1, so it goes out as soon
as it has been reduced (or, in the allgather, as soon as it has arrived). The
link then carries one unbroken stream of pieces in each direction, from the
first step of the scatter-reduce to the last of the allgather, and the
reduction of one piece overlaps the transfer of the next. A whole step sent as
one message, each phase after the other, left the link idle between them and
reached about 0.6 of a 1 Gbit/s link where the pipeline reaches 0.9.

Sends go out in the schedule's order (receives are matched in the order they
were posted, as MPI matches them). Over a link that holds a message arriving
before its receive in memory (horolite's TCP connections: `buffers_early`), at
most WINDOW more than the pieces that have arrived: the first step's pieces
WINDOW at a time, then one more for each piece that arrives from the left
neighbour, which sends under the same rule. So a rank that enters late finds at
most about WINDOW pieces waiting for it (copied once more, held in memory), not
a whole segment. (MPI's large messages wait for their receive by themselves.)

The schedule is a generator (`steps`) that yields each request it must wait
for, so several rings can be driven at once (transport/hierarchical.py).
"""
from __future__ import annotations

from collections import deque
from typing import Iterator, List, Optional, Sequence

import numpy as np

from ..core import kernels
from ..core.ops import ReduceOp

__all__ = ["Ring", "even_bounds", "row_bounds", "PIECE_BYTES"]

# Steps larger than this travel as several messages.
PIECE_BYTES = 1 << 20
# Scatter-reduce pieces received ahead of the one being reduced (each needs a scratch slot),
# and sends made ahead of the pieces received.
WINDOW = 8
# False: the first step's pieces all go out at once (bench/ring_send_ahead.py's A/B).
PACED = True


def even_bounds(count: int, parts: int) -> List[int]:
    """Boundaries splitting `count` elements into `parts` near-equal segments."""
    base, extra = divmod(count, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


def row_bounds(rows: int, row_elems: int, parts: int) -> List[int]:
    """Reducescatter's split: the first rows % parts ranks get one extra row."""
    return [b * row_elems for b in even_bounds(rows, parts)]


class Ring:
    def __init__(self, link):
        """`link` moves bytes between neighbours: see transport.mpi.PointToPoint."""
        self._link = link
        self._scratch = {}

    @property
    def rank(self) -> int:
        return self._link.rank

    @property
    def size(self) -> int:
        return self._link.size

    def _scratch_for(self, nbytes: int, lane: int) -> np.ndarray:
        have = self._scratch.get(lane)
        if have is None or have.nbytes < nbytes:
            # Grows to the largest window seen, then is reused: no steady-state allocation.
            have = np.empty(max(nbytes, 0 if have is None else 2 * have.nbytes), dtype=np.uint8)
            self._scratch[lane] = have
        return have

    def _run(self, steps: Iterator) -> None:
        wait = self._link.wait
        for req in steps:
            wait(req)

    def allreduce(self, buf: np.ndarray, op: ReduceOp, postscale: float = 1.0) -> None:
        """Reduce `buf` (1-D, contiguous) in place across all ranks."""
        self.allreduce_from(buf, buf, op, postscale)

    def allreduce_from(self, src: np.ndarray, dst: np.ndarray, op: ReduceOp,
                       postscale: float = 1.0) -> None:
        """dst = allreduce(src) (1-D, contiguous, same size; dst may be src) without copying
        src into dst first: step 0 sends from src, and each step writes dst[seg] = src[seg] op
        incoming, piece by piece while the piece is in cache."""
        if self.size == 1 or src.size == 0:
            if src is not dst or postscale != 1.0:
                kernels.pack(dst.view(np.uint8), [src], postscale)
            return
        bounds = even_bounds(src.size, self.size)
        self._run(self.steps(src, dst, bounds, op, postscale, True, True))

    def scatter_reduce(self, buf: np.ndarray, bounds: Sequence[int], op: ReduceOp,
                       postscale: float = 1.0) -> None:
        """After this, segment `rank` of `buf` holds the reduction over all ranks."""
        if self.size == 1:
            seg = buf[bounds[0]:bounds[1]]
            if postscale != 1.0 and seg.size:
                kernels.scale_into(seg, seg, postscale)
            return
        self._run(self.steps(buf, buf, bounds, op, postscale, True, False))

    def allgather(self, buf: np.ndarray, bounds: Sequence[int]) -> None:
        """Segment `rank` of `buf` is this rank's; afterwards every segment is filled."""
        if self.size > 1:
            self._run(self.steps(buf, buf, bounds, None, 1.0, False, True))

    def steps(self, src: np.ndarray, dst: np.ndarray, bounds: Sequence[int],
              op: Optional[ReduceOp], postscale: float, reduce: bool, gather: bool,
              tag: int = -1, lane: int = 0) -> Iterator:
        """The ring's schedule as a generator of the requests to wait for, in order.

        reduce: the scatter-reduce's n-1 steps (postscale applied in its last); gather:
        the allgather's n-1 steps. `tag` and `lane` (its scratch) keep rings that run at
        once on one link apart."""
        n, r, link = self.size, self.rank, self._link
        item = dst.itemsize
        plan = []  # per step: (segment sent, segment received, reduces)
        if reduce:
            plan += [((r - s - 1) % n, (r - s - 2) % n, True) for s in range(n - 1)]
        if gather:
            plan += [((r - t) % n, (r - t - 1) % n, False) for t in range(n - 1)]
        # Each segment is cut by its own size, so sender and receiver agree on the pieces,
        # and the piece received in one step is the piece sent in the next.
        pieces = []
        for q in range(n):
            lo, hi = bounds[q], bounds[q + 1]
            cut = even_bounds(hi - lo, _piece_count((hi - lo) * item))
            pieces.append([(lo + a, lo + b) for a, b in zip(cut, cut[1:])])
        slot_elems = max(hi - lo for seg in pieces for lo, hi in seg)
        slots = 0
        if reduce:
            scratch = self._scratch_for(WINDOW * slot_elems * item, lane)
            slots = [scratch[i * slot_elems * item:(i + 1) * slot_elems * item].view(dst.dtype)
                     for i in range(WINDOW)]
        sending = {}  # (segment, piece) -> the send still reading dst there
        sends = []  # every send not yet waited for
        last_reduce = n - 2

        def send(step, k, lo, hi):
            source = src if (step == 0 and reduce) else dst
            req = link.isend(_bytes(source[lo:hi]), tag=tag)
            sends.append(req)
            if source is dst:
                sending[(plan[step][0], k)] = req

        backlog = deque()  # sends due and not yet made, in order: (step, piece, lo, hi)
        queued = set()  # their (segment, piece)
        paced = PACED and getattr(link, "buffers_early", False)
        credit = [WINDOW if paced else 1 << 62]  # sends that may still be made

        def due(step, k, lo, hi):
            backlog.append((step, k, lo, hi))
            queued.add((plan[step][0], k))

        def flush(needed=None):
            """Make the sends the credit allows, and every one up to `needed`."""
            while backlog and (credit[0] > 0 or needed in queued):
                step, k, lo, hi = backlog.popleft()
                queued.discard((plan[step][0], k))
                credit[0] -= 1
                send(step, k, lo, hi)

        for k, (lo, hi) in enumerate(pieces[plan[0][0]]):
            due(0, k, lo, hi)
        flush()
        order = [(i, k) for i, (_, seg, _) in enumerate(plan) for k in range(len(pieces[seg]))]
        posted: List = []  # (step, piece, request, slot) in order
        free = list(range(len(slots) if reduce else 0))
        nxt = 0
        for done in range(len(order)):
            while nxt < len(order):  # post receives ahead, as far as the scratch allows
                i, k = order[nxt]
                seg = plan[i][1]
                lo, hi = pieces[seg][k]
                if plan[i][2]:
                    if not free:
                        break
                    slot = free.pop()
                    into = slots[slot][:hi - lo]
                else:
                    slot, into = -1, dst[lo:hi]
                    if (seg, k) in queued:  # its send reads there: made first
                        flush((seg, k))
                    busy = sending.pop((seg, k), None)
                    if busy is not None:  # MPI: no receive into a buffer still being sent
                        sends[:] = [q for q in sends if q is not busy]
                        yield busy
                posted.append((i, k, link.irecv(_bytes(into), tag=tag), slot))
                nxt += 1
            i, k, req, slot = posted[done]
            yield req
            seg = plan[i][1]
            lo, hi = pieces[seg][k]
            if slot >= 0:
                target = dst[lo:hi]
                if src is not dst:  # target starts as this rank's own contribution
                    np.copyto(target, src[lo:hi])
                kernels.reduce_into(target, slots[slot][:hi - lo], op,
                                    postscale if i == last_reduce else 1.0)
                free.append(slot)
            credit[0] += 1  # a piece arrived
            if i + 1 < len(plan):
                due(i + 1, k, lo, hi)
            flush()
        credit[0] = 1 << 62
        flush()  # (none left, as a rule)
        for req in sends:
            yield req


def _piece_count(nbytes: int) -> int:
    return max(1, -(-nbytes // PIECE_BYTES))


def _bytes(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint8)
