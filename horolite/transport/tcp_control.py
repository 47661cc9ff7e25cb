"""The control exchange across hosts over horolite's own TCP connections.

Every cycle the ranks OR a small control vector, and rank 0 gathers requests and
broadcasts its answer (negotiation). Over MPI each of those waits polls, and an idle
rank's wait lasts until its peers' next cycle: across hosts that polling took as much
CPU as the data plane once its pieces moved to TCP. Here the same three exchanges go
around a ring of TCP messages (tcp_link.py), whose waits sleep on a condition until a
message completes. The ring is the ranks that talk across hosts: every rank, or each
host's leader where a host's ranks meet on a control board first (host_control.py).
A ring costs one hop per participant where MPI's trees cost log2 of them, so it
serves up to RING_MAX participants; beyond that MPI keeps the control exchange.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np

from .tcp_link import TcpLink

__all__ = ["TcpControl", "RING_MAX"]

# The most participants (hosts' leaders, or ranks) whose control exchange goes round
# the TCP ring: (n - 1) hops of ~50 us each per round, against MPI's log2(n) polled ones.
RING_MAX = 16
_OR, _GATHER, _BCAST = 0, 1, 2
_INT = np.dtype("<i8")


class ControlWaiter:
    """The transport's control-plane watch, looked up at each wait: the lane gives the
    control plane a waiter of its own after the connections are made (split_control)."""

    def __init__(self, transport):
        self._transport = transport

    @property
    def watch(self):
        return self._transport.control_waiter.watch


class TcpControl:
    """OR, gather at the ring's first rank, and broadcast from it, over `link`'s ranks."""

    def __init__(self, link: TcpLink):
        self.link = link

    def or_in_place(self, out: np.ndarray) -> None:
        """out = the bitwise OR of every participant's `out` (a ring allgather, OR-ed
        as the pieces pass)."""
        link = self.link
        send = out.copy()
        for _ in range(link.size - 1):
            got = np.empty_like(out)
            link.wait_all([link.irecv(got, tag=_OR), link.isend(send, tag=_OR)])
            np.bitwise_or(out, got, out=out)
            send = got

    def gather_bytes(self, data: bytes) -> Optional[List[bytes]]:
        """Every participant's `data`, in ring order, at the first (None elsewhere): each
        passes what came from above it, with its own in front, one hop down."""
        link = self.link
        parts = [data]
        if link.rank < link.size - 1:
            parts += _split(self._receive(_GATHER, link.right))
        if link.rank == 0:
            return parts
        self._send(_join(parts), _GATHER, link.left)
        return None

    def bcast_bytes(self, data) -> bytes:
        """`data` from the first participant (ignored elsewhere), passed one hop up."""
        link = self.link
        if link.rank > 0:
            data = self._receive(_BCAST, link.left)
        if link.rank < link.size - 1:
            self._send(bytes(data), _BCAST, link.right)
        return bytes(data)

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
