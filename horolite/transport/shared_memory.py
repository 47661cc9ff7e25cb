"""Allreduce through memory shared by the ranks of one host.

Over MPI's point-to-point path every ring step moves its bytes through the
MPI library's own shared-memory buffers: two copies per step, plus the
reduction. When every rank of the job is on one host, the ranks can instead
share a window (MPI_Win_allocate_shared) and each byte is copied once into it,
reduced in place by the rank that owns it, and copied once out: the C loop in
native/shm_ring.c, block by block so a block is still in cache between the
three passes. Across hosts the ring over MPI is used as before.

Results the output pool placed in the ranks' result arenas (result_arena.py)
are written by the reducing rank directly, without the copy out.
"""
from __future__ import annotations

import logging
from typing import Optional, Sequence, Union

import numpy as np
from ..core.mpi_library import MPI

from ..core import kernels
from ..core.hosts import split_by_host
from .._native import ffi as _ffi, lib as _lib
from .result_arena import ResultArena, open_result_arena

__all__ = ["SharedMemoryAllreduce", "open_shared_memory"]

_log = logging.getLogger("horolite.transport.shared_memory")

# Per rank: a header page (progress counters) and SLOTS slots of SLOT_BYTES.
HEADER_BYTES = 4096
SLOT_BYTES = 1 << 20
SLOTS = 4
_WORDS = {"staged": _lib.HL_SHM_STAGED, "reduced": _lib.HL_SHM_REDUCED,
          "gathered": _lib.HL_SHM_GATHERED}
# Calls of at most this many bytes take one wait on the other ranks instead of two.
ONE_SHOT_BYTES = _lib.HL_SHM_ONE_SHOT_BYTES
# How often a wait in the C loop comes back to Python to check for failures and stalls.
WATCH_TICK = 0.25
# Address space for each rank's result arena; memory is used only as the
# output pool fills it, and the pool keeps at most half of this.
ARENA_BYTES = 4 << 30


class SharedMemoryAllreduce:
    """dst = allreduce(src) for the ranks of `comm`, all on this host."""

    def __init__(self, comm: MPI.Comm, polite: bool, report_after: float,
                 arena: Optional[ResultArena] = None):
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.polite = 1 if polite else 0
        self.report_after = report_after
        self._win = MPI.Win.Allocate_shared(HEADER_BYTES + SLOTS * SLOT_BYTES, 1, comm=comm)
        regions = []
        for q in range(self.size):
            buf, _ = self._win.Shared_query(q)
            regions.append(np.frombuffer(buf, dtype=np.uint8,
                                         count=HEADER_BYTES + SLOTS * SLOT_BYTES))
        self._regions = regions  # keeps the buffers (and the pointers below) alive
        self._counters = [r[:HEADER_BYTES].view(np.int64) for r in regions]
        self._counters[self.rank][:] = 0
        self._headers = _ffi.new("int64_t *[]", [_ffi.cast("int64_t *", _ffi.from_buffer(r))
                                                 for r in regions])
        self._slots = _ffi.new("char *[]", [_ffi.cast("char *", _ffi.from_buffer(r)) + HEADER_BYTES
                                            for r in regions])
        self.arena = arena
        if arena is not None:
            self._arenas = _ffi.new("char *[]", [_ffi.cast("char *", _ffi.from_buffer(m))
                                                 for m in arena.maps])
            self._arena_bytes = arena.capacity
        else:
            self._arenas, self._arena_bytes = _ffi.NULL, 0
        self._state = _ffi.new("int64_t[]", 2 + self.size)
        self._blocks = _ffi.new("int64_t *")
        self._epoch = 0  # blocks moved so far: the same on every rank
        self._one_part = np.zeros(2, dtype=np.int64)  # `starts` of a single input
        comm.Barrier()  # every rank's counters are zero before anyone reads them

    def allreduce(self, src: Union[np.ndarray, Sequence[np.ndarray]], dst: np.ndarray, op,
                  postscale: float, what: str = "", watch=None) -> None:
        """src and dst: 1-D, contiguous, same size and dtype; dst may be src. src may also
        be a list of 1-D contiguous arrays of dst's dtype, whose concatenation is the input:
        the members of a fused batch, read where they lie (no pack into dst first).
        `what` names the tensors in a stall report, e.g. "tensor 'w'". `watch(waited,
        ranks behind)` is called every WATCH_TICK of waiting and may raise to give up
        (collective_watch.py; it also reports the stall); without it, a warning every
        report_after seconds."""
        if isinstance(src, np.ndarray):
            parts = [src]
            starts = self._one_part
            starts[1] = src.size
        else:
            parts = src
            starts = np.zeros(len(parts) + 1, dtype=np.int64)
            np.cumsum([p.size for p in parts], out=starts[1:])
            if starts[-1] != dst.size:
                raise ValueError(f"{what or 'a tensor'}: the parts hold {starts[-1]} elements, "
                                 f"the result {dst.size}")
        code, opc = kernels.native_codes(dst.dtype, op)
        buffers = [_ffi.from_buffer(p) for p in parts]  # kept alive through the calls
        pointers = _ffi.new("char *[]", buffers)
        self._state[0] = 0
        self._state[1] = _lib.HL_SHM_UNPUBLISHED
        tick = min(WATCH_TICK, self.report_after) if watch is not None else self.report_after
        waited = 0.0
        while True:
            rc = _lib.hl_shm_allreduce(
                self._headers, self._slots, self._arenas, self._arena_bytes, self.size,
                self.rank, SLOT_BYTES, SLOTS, pointers,
                _ffi.cast("int64_t *", _ffi.from_buffer(starts)), len(parts),
                _ffi.from_buffer(dst, require_writable=True), dst.size, code, dst.itemsize,
                opc, postscale, self._epoch, self._state, tick, self.polite,
                self._blocks)
            if rc == 0:
                break
            if rc < 0:
                kernels.check(rc)
            waited += tick
            if watch is not None:
                watch(waited, self._behind())
            else:
                _log.warning("rank %d: %s has waited %.0f s in the shared-memory allreduce "
                             "for ranks %s", self.rank, what or "a tensor", waited,
                             self._behind())
        self._epoch += self._blocks[0]

    @property
    def last_mode(self) -> str:
        """How the last call ran (native/shm_ring.h): "gather" (some result private:
        each rank copied out), "direct" (results in arenas, written by their owners) or
        "shared" (also in place everywhere: nothing staged after the first block), or
        "one-shot" (at most ONE_SHOT_BYTES: each rank reduced every rank's copy)."""
        return {_lib.HL_SHM_GATHER: "gather", _lib.HL_SHM_DIRECT: "direct",
                _lib.HL_SHM_SHARED: "shared", _lib.HL_SHM_ONE_SHOT: "one-shot"}[self._state[1]]

    def _behind(self):
        """Ranks whose progress is behind this rank's (the ones being waited for)."""
        mine = self._counters[self.rank]
        return [q for q in range(self.size)
                if any(self._counters[q][w] < mine[w] for w in _WORDS.values())]

    def close(self) -> None:
        """Collective: only when every rank stops together."""
        self._headers = self._slots = self._arenas = None
        self._regions = self._counters = None
        if self.arena is not None:
            self.arena.close()
        self._win.Free()


def open_shared_memory(comm: MPI.Comm, polite: bool, report_after: float,
                       enabled: bool = True, arena: bool = True
                       ) -> Optional[SharedMemoryAllreduce]:
    """The shared-memory path when every rank of `comm` is on this host, else None.

    arena=False leaves results in private memory (always copied out).
    Collective over `comm`: every rank gets the same answer.
    """
    if comm.Get_size() < 2 or not enabled:
        return None
    local = split_by_host(comm)
    try:
        all_local = local.Get_size() == comm.Get_size()
    finally:
        local.Free()
    # Every rank's view agrees (the host split is a partition), but make it explicit.
    if not comm.allreduce(all_local, op=MPI.LAND):
        return None
    results = open_result_arena(comm, ARENA_BYTES) if arena else None
    try:
        shared = SharedMemoryAllreduce(comm, polite, report_after, results)
        error = None
    except MPI.Exception as exc:  # e.g. a container's small /dev/shm
        shared, error = None, exc
        comm.Barrier()  # the one the constructor ends with: keep the collectives in step
    if not comm.allreduce(error is None, op=MPI.LAND):
        _log.warning("rank %d: no shared-memory window (%s); allreduce uses the ring over MPI",
                     comm.Get_rank(), error or "another rank could not allocate one")
        if results is not None:
            results.close()
        return None  # a window some rank did allocate is left to process exit
    return shared
