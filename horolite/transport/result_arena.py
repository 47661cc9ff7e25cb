"""Result arrays the other ranks of the host can write into.

The shared-memory allreduce ends with every rank copying the whole reduced
buffer out of the staging slots into its private result: the result crosses
from the core that reduced it to every other core a second time. When the
result array itself lies in memory every rank has mapped, the rank that
reduces a segment writes it straight into every rank's result instead
(native/shm_ring.c, "direct"). This module is that memory: one memfd per rank,
mapped by the others through /proc/<pid>/fd, carved into result arrays by the
output pool (execution/output_pool.py), which keeps and reuses them.
"""
from __future__ import annotations

import logging
import mmap
import os
import secrets
from typing import Optional

import numpy as np
from ..core.mpi_library import MPI

__all__ = ["ResultArena", "open_result_arena"]

_log = logging.getLogger("horolite.transport.result_arena")

PAGE = 4096


def _address(mm: mmap.mmap) -> int:
    """Where a mapping starts in this process."""
    return np.frombuffer(mm, dtype=np.uint8, count=1).__array_interface__["data"][0]


class ResultArena:
    """This rank's arena (pages exist only once handed out) and the others' mapped here.

    The output pool keeps the arrays it gets from here and hands them out again;
    when what a job reduces changes, it gives back ones nobody holds (release),
    whose pages go back to the system and whose range is handed out again, first
    fit. What the pool keeps in all is bounded (OutputPool.MAX_BYTES), so the
    arena only needs to be larger than that (and than its holes).
    """

    def __init__(self, comm: MPI.Comm, capacity: int):
        self.rank = comm.Get_rank()
        self.capacity = capacity
        fd = os.memfd_create("horolite-results", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, capacity)
            self._fd = fd
            self._own = mmap.mmap(fd, capacity)
        except OSError:
            os.close(fd)
            raise
        self._next = 0
        self._holes = []  # released [start, end) ranges, sorted, none adjacent
        self.maps = [None] * comm.Get_size()
        self.maps[self.rank] = self._own

    def map_peers(self, comm: MPI.Comm) -> None:
        """Collective: map every other rank's arena. Raises OSError where that is refused."""
        token = secrets.token_bytes(16)
        self._own[:16] = token  # overwritten by the first array: only proves the mapping
        peers = comm.allgather((os.getpid(), self._fd, token))
        error = None
        for q, (pid, fd, their_token) in enumerate(peers):
            if q == self.rank:
                continue
            try:
                peer_fd = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
                try:
                    self.maps[q] = mmap.mmap(peer_fd, self.capacity)
                finally:
                    os.close(peer_fd)
                if self.maps[q][:16] != their_token:
                    raise OSError(f"rank {q}'s arena, mapped here, is not the one it wrote")
            except OSError as exc:
                error = error or exc
        if error is not None:
            raise error

    def empty(self, shape, dtype) -> Optional[np.ndarray]:
        """A new array in the arena, or None when it is full or the pages cannot be had."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        length = (nbytes + PAGE - 1) // PAGE * PAGE
        hole = next((i for i, (a, b) in enumerate(self._holes) if b - a >= length), None)
        start = self._next if hole is None else self._holes[hole][0]
        end = start + length
        if end > self.capacity:
            return None
        try:
            # The pages now, or a clean failure now: out of memory would otherwise
            # show up as SIGBUS at the first write into them.
            os.posix_fallocate(self._fd, start, end - start)
        except OSError:
            return None
        if hole is None:
            self._next = end
        elif end == self._holes[hole][1]:
            del self._holes[hole]
        else:
            self._holes[hole] = (end, self._holes[hole][1])
        # Made in its final shape, straight on the mapping: NumPy points every view of
        # it at it (a reshaped view would be skipped), which the pool's reuse test needs.
        return np.ndarray(shape, dtype=dtype, buffer=self._own, offset=start)

    def owns(self, array: np.ndarray) -> bool:
        """Whether `array` came from empty()."""
        return array.base is self._own

    def release(self, array: np.ndarray) -> None:
        """Give back an array from empty() that nothing refers to any more (not even
        another rank: only its owner's allreduce writes into it)."""
        start = array.__array_interface__["data"][0] - _address(self._own)
        length = (array.nbytes + PAGE - 1) // PAGE * PAGE
        try:  # its pages back to the system (a hole in the memfd, for every mapping)
            self._own.madvise(mmap.MADV_REMOVE, start, length)
        except (AttributeError, OSError, ValueError):
            pass  # kept: handed out again all the same
        end = start + length
        if end == self._next:
            self._next = start
        else:
            self._holes.append((start, end))
            self._holes.sort()
        merged = []
        for a, b in self._holes:
            if merged and merged[-1][1] == a:
                merged[-1] = (merged[-1][0], b)
            else:
                merged.append((a, b))
        if merged and merged[-1][1] == self._next:
            self._next = merged.pop()[0]
        self._holes = merged

    def close(self) -> None:
        """Unmap the other ranks' arenas; ours stays for as long as a result refers to it."""
        self.maps = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def open_result_arena(comm: MPI.Comm, capacity: int) -> Optional[ResultArena]:
    """This rank's result arena, every other rank's mapped, or None on every rank.

    Collective over `comm`.
    """
    arena, error = None, None
    try:
        if not hasattr(os, "memfd_create"):
            raise OSError("no memfd_create on this platform")
        arena = ResultArena(comm, capacity)
    except OSError as exc:
        error = exc
    if comm.allreduce(error is None, op=MPI.LAND):
        try:
            arena.map_peers(comm)
        except OSError as exc:
            error = exc
        if comm.allreduce(error is None, op=MPI.LAND):
            return arena
    _log.info("rank %d: results are private memory (%s); the shared-memory allreduce "
              "copies them out itself", comm.Get_rank(),
              error or "another rank could not share its results")
    if arena is not None:
        arena.close()
    return None
