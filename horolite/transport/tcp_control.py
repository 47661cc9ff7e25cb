"""The control exchange across hosts over horolite's own TCP connections.

Every cycle the ranks OR a small control vector, and rank 0 gathers requests and
broadcasts its answer (negotiation). Over MPI each of those waits polls, and an idle
rank's wait lasts until its peers' next cycle: across hosts that polling took as much
CPU as the data plane once its pieces moved to TCP. Here the same three exchanges go
over TCP messages (tcp_link.py, on each peer's express connection), whose waits sleep
on a condition until a message completes, among the ranks that talk across hosts:
every rank, or each host's leader where a host's ranks meet on a control board first
(host_control.py).

They take log2(n) steps, as MPI's do, at any size: the OR by recursive doubling (the
ranks above the largest power of two fold into a partner first and hear the result
from it last), the gather and the broadcast along a binomial tree rooted at the first
participant. Each participant is connected to those 2**k away (partners()), about
2 log2(n) connections. The ring of n - 1 hops per exchange stays as a shape to measure
against (bench/control_plane.py).
"""
from __future__ import annotations

from typing import List, Optional, Set

import numpy as np

from .tcp_link import TcpLink

__all__ = ["TcpControl", "partners"]

_OR, _GATHER, _BCAST = 0, 1, 2
# The runtime's shape ("tree"; "ring" only to measure against: bench/control_plane.py).
SHAPE = "tree"
_INT = np.dtype("<i8")


def _floor_pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def partners(index: int, n: int, shape: str = "") -> Set[int]:
    """The participants that `index` (of `n`) exchanges control messages with."""
    shape = shape or SHAPE
    if n < 2:
        return set()
    if shape == "ring":
        return {(index + 1) % n, (index - 1) % n} - {index}
    found, k = set(), 1
    while k < n:  # the trees', recursive doubling's and the fold's partners: index +- 2**j
        for q in (index + k, index - k):
            if 0 <= q < n:
                found.add(q)
        k <<= 1
    return found


class ControlWaiter:
    """The transport's control-plane watch, looked up at each wait: the lane gives the
    control plane a waiter of its own after the connections are made (split_control)."""

    def __init__(self, transport):
        self._transport = transport

    @property
    def watch(self):
        return self._transport.control_waiter.watch


class TcpControl:
    """OR, gather at the first participant, and broadcast from it, over `link`'s ranks."""

    def __init__(self, link: TcpLink, shape: str = ""):
        self.link = link
        self.shape = shape or SHAPE

    def or_in_place(self, out: np.ndarray) -> None:
        """out = the bitwise OR of every participant's `out`."""
        if self.shape == "ring":
            return self._ring_or(out)
        link, me, n = self.link, self.link.rank, self.link.size
        p = _floor_pow2(n)
        got = np.empty_like(out)
        if me >= p:  # fold in, then hear the result
            link.wait(link.isend(out, me - p, _OR))
            link.wait(link.irecv(out, me - p, _OR))
            return
        if me + p < n:
            link.wait(link.irecv(got, me + p, _OR))
            np.bitwise_or(out, got, out=out)
        k = 1
        while k < p:
            partner = me ^ k
            link.wait_all([link.irecv(got, partner, _OR), link.isend(out.copy(), partner, _OR)])
            np.bitwise_or(out, got, out=out)
            k <<= 1
        if me + p < n:
            link.wait(link.isend(out, me + p, _OR))

    def _ring_or(self, out: np.ndarray) -> None:
        link = self.link
        send = out.copy()
        for _ in range(link.size - 1):
            got = np.empty_like(out)
            link.wait_all([link.irecv(got, tag=_OR), link.isend(send, tag=_OR)])
            np.bitwise_or(out, got, out=out)
            send = got

    def gather_bytes(self, data: bytes) -> Optional[List[bytes]]:
        """Every participant's `data`, in order, at the first (None elsewhere)."""
        link, me, n = self.link, self.link.rank, self.link.size
        parts = [data]
        if self.shape == "ring":
            if me < n - 1:
                parts += _split(self._receive(_GATHER, link.right))
            if me == 0:
                return parts
            self._send(_join(parts), _GATHER, link.left)
            return None
        k = 1
        while k < n:  # a binomial tree: each node holds [me, me + k) in order, then 2k
            if me & k:
                self._send(_join(parts), _GATHER, me - k)
                return None
            if me + k < n:
                parts += _split(self._receive(_GATHER, me + k))
            k <<= 1
        return parts

    def bcast_bytes(self, data) -> bytes:
        """`data` from the first participant (ignored elsewhere)."""
        link, me, n = self.link, self.link.rank, self.link.size
        if self.shape == "ring":
            if me > 0:
                data = self._receive(_BCAST, link.left)
            if me < n - 1:
                self._send(bytes(data), _BCAST, link.right)
            return bytes(data)
        k = _floor_pow2(n - 1) << 1 if n > 1 else 1
        if me:  # hear it from the parent: me with its lowest set bit cleared
            low = me & -me
            data = self._receive(_BCAST, me - low)
            k = low
        data = bytes(data)
        k >>= 1
        while k:
            if me + k < n:
                self._send(data, _BCAST, me + k)
            k >>= 1
        return data

    def _send(self, blob: bytes, tag: int, dest: int) -> None:
        link = self.link
        link.wait_all([link.isend(np.array([len(blob)], dtype=_INT), dest, tag),
                       link.isend(np.frombuffer(blob, dtype=np.uint8), dest, tag)])

    def _receive(self, tag: int, source: int) -> bytes:
        link = self.link
        length = np.zeros(1, dtype=_INT)
        link.wait(link.irecv(length, source, tag))
        blob = np.empty(int(length[0]), dtype=np.uint8)
        link.wait(link.irecv(blob, source, tag))
        return blob.tobytes()


def _join(parts: List[bytes]) -> bytes:
    lengths = np.array([len(p) for p in parts], dtype=_INT)
    return np.array([len(parts)], dtype=_INT).tobytes() + lengths.tobytes() + b"".join(parts)


def _split(blob: bytes) -> List[bytes]:
    count = int(np.frombuffer(blob, dtype=_INT, count=1)[0])
    lengths = np.frombuffer(blob, dtype=_INT, count=count, offset=_INT.itemsize).tolist()
    offset = _INT.itemsize * (1 + count)
    parts = []
    for n in lengths:
        parts.append(blob[offset:offset + n])
        offset += n
    return parts
