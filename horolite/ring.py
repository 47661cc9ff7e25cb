"""The bandwidth-optimal ring over point-to-point messages.

Allreduce is a scatter-reduce (n-1 steps) then an allgather (n-1 steps); each
rank sends and receives about 2(n-1)/n of the buffer, whatever n is. The
segment schedule is chosen so that after the scatter-reduce rank r owns
segment r, which makes reducescatter the first half of allreduce and
allgather the second half. Large steps are cut into pieces so the reduction
of one piece overlaps the transfer of the next.
"""
from __future__ import annotations

from typing import List, Sequence

import numpy as np

from . import kernels
from .ops import ReduceOp

__all__ = ["Ring", "even_bounds", "row_bounds"]

# Steps larger than this travel as several messages, so reducing piece k
# overlaps receiving piece k+1.
PIECE_BYTES = 1 << 20


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
        self._scratch = np.empty(0, dtype=np.uint8)

    @property
    def rank(self) -> int:
        return self._link.rank

    @property
    def size(self) -> int:
        return self._link.size

    def _scratch_for(self, nbytes: int) -> np.ndarray:
        if self._scratch.nbytes < nbytes:
            # Grows to the largest step seen, then is reused: no steady-state allocation.
            self._scratch = np.empty(max(nbytes, 2 * self._scratch.nbytes), dtype=np.uint8)
        return self._scratch

    def allreduce(self, buf: np.ndarray, op: ReduceOp, postscale: float = 1.0) -> None:
        """Reduce `buf` (1-D, contiguous) in place across all ranks."""
        if self.size == 1 or buf.size == 0:
            if postscale != 1.0 and buf.size:
                kernels.scale_into(buf, buf, postscale)
            return
        bounds = even_bounds(buf.size, self.size)
        self.scatter_reduce(buf, bounds, op, postscale)
        self.allgather(buf, bounds)

    def allreduce_from(self, src: np.ndarray, dst: np.ndarray, op: ReduceOp,
                       postscale: float = 1.0) -> None:
        """dst = allreduce(src) (1-D, contiguous, same size) without copying src into dst
        first: step 0 sends from src, and each step writes dst[seg] = src[seg] op incoming,
        piece by piece while the piece is in cache; the allgather fills the rest of dst."""
        if self.size == 1 or src.size == 0:
            kernels.pack(dst.view(np.uint8), [src], postscale)
            return
        n, r = self.size, self.rank
        bounds = even_bounds(src.size, n)
        largest = max(bounds[i + 1] - bounds[i] for i in range(n))
        scratch = self._scratch_for(largest * src.itemsize)
        for step in range(n - 1):
            send_seg, recv_seg = (r - step - 1) % n, (r - step - 2) % n
            send = (src if step == 0 else dst)[bounds[send_seg]:bounds[send_seg + 1]]
            target = dst[bounds[recv_seg]:bounds[recv_seg + 1]]
            base = src[bounds[recv_seg]:bounds[recv_seg + 1]]
            incoming = scratch[:target.nbytes].view(src.dtype)
            scale = postscale if step == n - 2 else 1.0
            self._exchange_and_reduce(send, incoming, target, op, scale, base=base)
        self.allgather(dst, bounds)

    def scatter_reduce(self, buf: np.ndarray, bounds: Sequence[int], op: ReduceOp,
                       postscale: float = 1.0) -> None:
        """After this, segment `rank` of `buf` holds the reduction over all ranks."""
        n, r = self.size, self.rank
        if n == 1:
            seg = buf[bounds[0]:bounds[1]]
            if postscale != 1.0 and seg.size:
                kernels.scale_into(seg, seg, postscale)
            return
        itemsize = buf.itemsize
        largest = max(bounds[i + 1] - bounds[i] for i in range(n))
        scratch = self._scratch_for(largest * itemsize)
        for step in range(n - 1):
            send_seg = (r - step - 1) % n
            recv_seg = (r - step - 2) % n
            send = buf[bounds[send_seg]:bounds[send_seg + 1]]
            target = buf[bounds[recv_seg]:bounds[recv_seg + 1]]
            incoming = scratch[:target.size * itemsize].view(buf.dtype)
            scale = postscale if step == n - 2 else 1.0
            self._exchange_and_reduce(send, incoming, target, op, scale)

    def allgather(self, buf: np.ndarray, bounds: Sequence[int]) -> None:
        """Segment `rank` of `buf` is this rank's; afterwards every segment is filled."""
        n, r = self.size, self.rank
        for step in range(n - 1):
            send_seg = (r - step) % n
            recv_seg = (r - step - 1) % n
            self._link.sendrecv(_bytes(buf[bounds[send_seg]:bounds[send_seg + 1]]),
                                _bytes(buf[bounds[recv_seg]:bounds[recv_seg + 1]]))

    def _exchange_and_reduce(self, send: np.ndarray, incoming: np.ndarray, target: np.ndarray,
                             op: ReduceOp, postscale: float, base=None) -> None:
        # Each message is cut by its own size, so sender and receiver agree on the pieces.
        item = send.itemsize
        recv_bounds = even_bounds(target.size, _piece_count(target.nbytes))
        send_bounds = even_bounds(send.size, _piece_count(send.nbytes))
        send_b, recv_b = _bytes(send), _bytes(incoming)
        recvs = [self._link.irecv(recv_b[lo * item:hi * item])
                 for lo, hi in zip(recv_bounds, recv_bounds[1:])]
        sends = [self._link.isend(send_b[lo * item:hi * item])
                 for lo, hi in zip(send_bounds, send_bounds[1:])]
        for k, req in enumerate(recvs):
            self._link.wait(req)
            lo, hi = recv_bounds[k], recv_bounds[k + 1]
            if hi > lo:
                if base is not None:  # target starts as this rank's own contribution
                    np.copyto(target[lo:hi], base[lo:hi])
                kernels.reduce_into(target[lo:hi], incoming[lo:hi], op, postscale)
        self._link.wait_all(sends)


def _piece_count(nbytes: int) -> int:
    return max(1, -(-nbytes // PIECE_BYTES))


def _bytes(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint8)
