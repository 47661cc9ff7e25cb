"""The control exchange and negotiation across hosts, through one rank per host.

With several hosts the per-cycle control vector and rank 0's negotiation would go
through MPI between every rank, and every rank would poll MPI while it waits. Here
the ranks of each host meet on a control board of their own (control_board.py):
the host's vectors are OR-ed there, and only the host's first rank (its leader)
takes the result over MPI to the other hosts' leaders, then brings the job's OR
back through a second round of the board. Negotiation the same way: each host's
requests are gathered on the board, the leaders send them to rank 0 (a leader:
the first rank of its host), and rank 0's answer comes back from the leaders
through the board. So the network carries one message per host, as the
hierarchical allreduce does for data, and the other ranks of a host sleep in the
board's futex, woken by their leader, instead of polling MPI.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np
from ..core.mpi_library import MPI

from ..core.hosts import split_by_host
from .control_board import ControlBoard
from .mpi import bcast_bytes, gather_bytes

__all__ = ["HostControl", "open_host_control"]

_LENGTH = np.dtype("<i8")


class HostControl:
    """Collective over `comm`, whose ranks span several hosts."""

    def __init__(self, comm: MPI.Comm, local: MPI.Comm, words: int, polite: bool):
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.waiter = None  # set by the transport (mpi.MPITransport)
        # The leaders' exchange over horolite's TCP connections (tcp_control.TcpControl,
        # set on leaders by tcp.attach), else None: MPI among the leaders.
        self.tcp = None
        self.leader = local.Get_rank() == 0
        # (the first rank of each host leads it: rank 0 leads its host and the leaders)
        self.leaders = comm.Split(0 if self.leader else MPI.UNDEFINED, self.rank)
        self.local_ranks: List[int] = local.allgather(self.rank)
        # Every host's ranks, in the leaders' order: how rank 0 lays out what it gathers.
        leader_of = comm.allgather(self.local_ranks[0])
        self.hosts = [[q for q in range(self.size) if leader_of[q] == first]
                      for first in sorted(set(leader_of))]
        self.board = ControlBoard(local, words, polite) if local.Get_size() > 1 else None
        self.wake = self.board.wake if self.board is not None else None
        local.Free()
        self._zeros = None

    def _watch(self):
        """The waiter's watch, told job ranks rather than the board's own numbers."""
        watch = self.waiter.watch
        if watch is None:
            return None
        ranks = self.local_ranks
        return lambda waited, peers=None: watch(
            waited, [ranks[q] for q in peers] if isinstance(peers, list) else peers)

    def exchange_or(self, vector: np.ndarray, out: np.ndarray, idle=None,
                    urgent: bool = False) -> None:
        """out = the bitwise OR of every rank's uint64 `vector`."""
        board, watch = self.board, self._watch()
        if board is not None:
            board.exchange_or(vector, out, watch, idle, urgent)  # the host's OR
        else:
            out[:] = vector
        if self.leader and self.tcp is not None:
            self.tcp.or_in_place(out)
        elif self.leader:
            self.waiter.guard()
            self.waiter.wait(self.leaders.Iallreduce(MPI.IN_PLACE, out, op=MPI.BOR), idle=idle)
        if board is not None:  # the leader's answer to the rest of the host
            if not self.leader and (self._zeros is None or self._zeros.size != out.size):
                self._zeros = np.zeros_like(out)
            board.exchange_or(out if self.leader else self._zeros, out, watch, idle,
                              quiet=True)

    def gather_bytes(self, data: bytes) -> Optional[List[bytes]]:
        """Every rank's `data` at rank 0 (a list in rank order; None elsewhere)."""
        parts = (self.board.gather_bytes(data, 0, self._watch()) if self.board is not None
                 else [data])
        if not self.leader:
            return None
        lengths = np.array([len(p) for p in parts], dtype=_LENGTH)
        blob = lengths.tobytes() + b"".join(parts)
        blobs = (self.tcp.gather_bytes(blob) if self.tcp is not None
                 else gather_bytes(self.leaders, self.waiter, blob, 0))
        if blobs is None:
            return None
        gathered: List[bytes] = [b""] * self.size
        for ranks, blob in zip(self.hosts, blobs):
            sizes = np.frombuffer(blob, dtype=_LENGTH, count=len(ranks))
            offset = sizes.nbytes
            for q, n in zip(ranks, sizes.tolist()):
                gathered[q] = blob[offset:offset + n]
                offset += n
        return gathered

    def bcast_bytes(self, data) -> bytes:
        """`data` from rank 0 (ignored elsewhere) on every rank."""
        if self.leader:
            data = (self.tcp.bcast_bytes(data) if self.tcp is not None
                    else bcast_bytes(self.leaders, self.waiter, data, 0))
        if self.board is not None:
            data = self.board.bcast_bytes(data, 0, self._watch())
        return data

    def close(self) -> None:
        """Collective: only when every rank stops together."""
        if self.board is not None:
            self.board.close()
        if self.leaders != MPI.COMM_NULL:
            try:
                self.leaders.Free()
            except MPI.Exception:
                pass


def open_host_control(comm: MPI.Comm, words: int, polite: bool,
                      enabled: bool) -> Optional[HostControl]:
    """A HostControl when `enabled` (shared memory allowed) and the ranks of `comm` span
    several hosts, one of which holds two or more of them; else None. Collective."""
    if not enabled or comm.Get_size() < 3:
        return None
    local = split_by_host(comm)
    sizes = comm.allgather(local.Get_size())
    if max(sizes) < 2 or min(sizes) == comm.Get_size():
        local.Free()
        return None
    return HostControl(comm, local, words, polite)
