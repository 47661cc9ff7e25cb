"""Connections kept from one generation of an elastic job's world to the next.

When survivors of a failure (or every rank, at a commit that lets a new worker in)
move to the next generation, two ranks that were connected and both stay keep their
connection instead of dialling again: at 16 ranks that is 120 connections and their
hellos not made again. The rest of the new world connects as always.

A kept connection is safe to carry over because:
- each side ends the old world's messages with a FENCE (sockets_mesh.Mesh.park), and
  the old reader stops there, so nothing sent in the older world is read in the newer;
- both sides keep it only if each names the other's worker and the same generation
  it was made in (agreed through the rendezvous entries of the new world);
- the first frame of the new world on it is a REBIND, a MAC under the new generation's
  key over both ranks' new numbers: a peer of an older world cannot make it.
A kept connection that fails any of these fails the world's set-up, as a dial that
fails does; what was parked and not taken is closed.
"""
from __future__ import annotations

import hashlib
import hmac
import socket
import time
from typing import Callable, Dict, Tuple

from .sockets_mesh import HEADER, Mesh, close_socket, read_into

__all__ = ["KeptLinks", "rebind", "REBIND"]

REBIND = (1 << 64) - 2  # (a context no communicator has: "this connection, the new world")
MAC_BYTES = 32


class KeptLinks:
    """One rank's connections parked between two worlds, by the peer's worker name."""

    def __init__(self):
        # peer's worker name -> (socket, fenced(deadline), generation it was made in)
        self._parked: Dict[str, Tuple[socket.socket, Callable[[float], bool], int]] = {}

    def park(self, mesh: Mesh, workers: Dict[int, str], generation: int) -> None:
        """Leave `generation`'s world keeping its open connections to named workers."""
        self.drop_all()
        for q, (sock, fenced) in mesh.park().items():
            name = workers.get(q)
            if name:
                self._parked[name] = (sock, fenced, generation)
            else:
                close_socket(sock)

    def offer(self) -> Dict[str, int]:
        """What this rank can keep, for its rendezvous entry: {peer worker: generation}."""
        return {name: generation for name, (_, _, generation) in self._parked.items()}

    def agree(self, me: str, peers: list, rank: int) -> Dict[int, Tuple]:
        """The parked connections that this rank and each peer both offer, by the peer's
        rank in the new world (`peers`: every rank's rendezvous entry)."""
        taken = {}
        for q, peer in enumerate(peers):
            name = peer.get("worker")
            if q == rank or not name or name not in self._parked:
                continue
            if peer.get("kept", {}).get(me) == self._parked[name][2]:
                taken[q] = self._parked.pop(name)
        return taken

    def drop_all(self) -> None:
        """Close what was parked and not taken."""
        for sock, _, _ in self._parked.values():
            close_socket(sock)
        self._parked.clear()


def _mac(key: bytes, generation: int, sender: int, receiver: int, made_in: int) -> bytes:
    return hmac.new(key, b"horolite rebind %d %d>%d %d" % (generation, sender, receiver,
                                                            made_in), hashlib.sha256).digest()


def rebind(taken: Dict[int, Tuple[socket.socket, Callable, int]], rank: int, generation: int,
           key: bytes, deadline: float, where: Callable[[int], str]) -> Dict[int, socket.socket]:
    """Say REBIND on every kept connection, then read each peer's: {rank: socket}.
    `key`: the new generation's. ConnectionError naming the peer when one does not hold."""
    socks, q = {}, None
    try:
        for q, (sock, _, made_in) in taken.items():
            socks[q] = sock
            sock.sendall(HEADER.pack(REBIND, generation, MAC_BYTES)
                         + _mac(key, generation, rank, q, made_in))
        for q, (sock, fenced, made_in) in taken.items():
            if not fenced(deadline):
                raise ConnectionError("it did not leave the world before")
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            frame = bytearray(HEADER.size + MAC_BYTES)
            if not read_into(sock, memoryview(frame)):
                raise ConnectionError("it closed the connection")
            context, tag, n = HEADER.unpack(frame[:HEADER.size])
            if (context, tag, n) != (REBIND, generation, MAC_BYTES) or not hmac.compare_digest(
                    bytes(frame[HEADER.size:]), _mac(key, generation, q, rank, made_in)):
                raise ConnectionError(f"it did not rebind it to generation {generation}")
            sock.settimeout(None)
    except OSError as e:
        for sock in socks.values():
            close_socket(sock)
        raise ConnectionError(f"rank {rank}: the connection kept from generation {made_in} "
                              f"for {where(q)} failed: {e}") from None
    return socks
