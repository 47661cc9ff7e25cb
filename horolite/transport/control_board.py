"""The per-cycle control exchange, and rank 0's negotiation, through memory the ranks
of one host share (native/shm_board.c), instead of MPI's nonblocking collectives.

Over MPI, a rank waiting in the control allreduce has to poll it (MPI makes progress
only when asked), so the later rank's arrival is seen at the earlier rank's next look.
Here every rank writes its vector into the board and enters the round; the last to
enter wakes the others from a futex. Entering also rings the doorbell of the ranks
still pausing between cycles that the round concerns: all of them for flags (new
requests, shutdown, join, rank 0's word), the ones with work in flight for newly ready
work (an idle rank comes when its own caller submits). The doorbell is the runtime's
wake-up (`wake`, what submits and the TensorFlow ops ring), so the background thread
sleeps on one word whether local work or a peer is what it waits for. Nothing on the
way waits for a timer: the last rank's entry completes a round the others wait in.

The board is an MPI shared window over the runtime's communicator (a process set's
board is its own). Its memory stays mapped until the process exits: the doorbell's
address is handed to native code (tensorflow/intake.py) that may ring it late.
"""
from __future__ import annotations

import time
from typing import List, Optional

import numpy as np
from ..core.mpi_library import MPI

from .._native import ffi as _ffi, lib as _lib
from ..core import kernels
from ..core.wake import Wake
from ..errors import HorovodInternalError

__all__ = ["ControlBoard", "MAILBOX_BYTES", "open_control_board"]

# Bytes each rank can post in one round; longer messages take several rounds.
MAILBOX_BYTES = 64 << 10
# A control round's mailbox opens with the table of the small tensors it carries
# (hl_board_reduce_carried: a count, then (slot, offset, bytes) per tensor); their
# bytes follow, each on a line of its own.
CARRY_TABLE_BYTES = 1024
CARRY_MAX_TENSORS = (CARRY_TABLE_BYTES - 8) // 24
# How long a wait spins before it sleeps (more ranks than cores: barely).
SPIN_SECONDS, POLITE_SPIN_SECONDS = 50e-6, 2e-6
# How often a wait comes back to hear of failures and stalls (collective_watch.py).
WATCH_TICK = 0.02

_retired: List[MPI.Win] = []  # boards of closed runtimes: mapped until exit (see above)


class ControlBoard:
    """Rounds of exchange between the ranks of `comm`, all on this host (collective)."""

    def __init__(self, comm: MPI.Comm, words: int, polite: bool):
        self.rank, self.size, self.words = comm.Get_rank(), comm.Get_size(), words
        nbytes = _lib.hl_board_bytes(self.size, words, MAILBOX_BYTES)
        self._win = MPI.Win.Allocate_shared(nbytes if self.rank == 0 else 0, 1, comm=comm)
        buf, _ = self._win.Shared_query(0)
        self._mem = np.frombuffer(buf, dtype=np.uint8, count=nbytes)
        if self.rank == 0:
            self._mem[:] = 0
        comm.Barrier()  # zeroed before anyone enters
        self._base = _ffi.cast("char *", _ffi.from_buffer(self._mem))
        self._args = (self._base, self.size, words, MAILBOX_BYTES)
        self.wake = Wake(_lib.hl_board_doorbell(*self._args, self.rank))
        self._spin = POLITE_SPIN_SECONDS if polite else SPIN_SECONDS
        self._vectors = [self._view(_lib.hl_board_vector(*self._args, self.rank, p), words * 8,
                                    np.uint64) for p in (0, 1)]
        self._boxes = [[self._view(_lib.hl_board_mailbox(*self._args, q, p), MAILBOX_BYTES,
                                   np.uint8) for p in (0, 1)] for q in range(self.size)]
        self._lengths = [[self._view(_lib.hl_board_vector(*self._args, q, p), words * 8,
                                     np.uint64) for p in (0, 1)] for q in range(self.size)]
        self._tables = [self._view(_lib.hl_board_mailbox(*self._args, self.rank, p),
                                   CARRY_TABLE_BYTES, np.int64) for p in (0, 1)]
        self._round = 0
        self._carried_round = -1  # the last control round (what reduce_carried reads)
        self._busy = False
        self._out = None  # (the array exchange_or last wrote to, a pointer to it)

    @staticmethod
    def _view(pointer, nbytes: int, dtype) -> np.ndarray:
        return np.frombuffer(_ffi.buffer(pointer, nbytes), dtype=dtype)

    @property
    def rounds(self) -> int:
        """Rounds completed so far (the same on every rank)."""
        return self._round

    def behind(self) -> List[int]:
        """The ranks that have not entered the current round (what a wait waits for)."""
        return [q for q in range(self.size)
                if _lib.hl_board_entered(*self._args, q) <= self._round]

    def awaited(self) -> bool:
        """Whether some rank has entered the round this rank has not (it waits for it)."""
        return len(self.behind()) < self.size

    def set_busy(self, busy: bool) -> None:
        """Say whether this rank has work in flight (a peer bringing new ready work rings it)."""
        if busy != self._busy:
            self._busy = busy
            _lib.hl_board_set_busy(*self._args, self.rank, int(busy))

    def _run(self, watch, idle, ring: int = _lib.HL_BOARD_RING_NONE) -> int:
        """Enter the round whose slot is written and wait until every rank has; its number."""
        k = self._round
        _lib.hl_board_enter(*self._args, self.rank, k, ring)
        waited, last = 0.0, None
        while _lib.hl_board_wait(*self._args, k, WATCH_TICK, self._spin):
            if watch is None:
                continue
            # Nothing of this rank's rides on an idle round: it is not a stall.
            now = time.monotonic()
            if idle is None or idle.is_set():
                waited += (now - last) if last is not None else WATCH_TICK
            last = now
            watch(waited, self.behind())
        self._round = k + 1
        return k

    def exchange_or(self, vector: np.ndarray, out: np.ndarray, watch=None, idle=None,
                     urgent: bool = False, quiet: bool = False) -> None:
        """out = the bitwise OR of every rank's uint64 `vector` (this round's). `urgent`:
        the vector asks every rank to act (flags), so it wakes every rank not in the round;
        otherwise a vector that changed since this rank's last round (new work ready)
        wakes the ranks with work in flight, and an unchanged one nobody; `quiet`: nobody."""
        mine = self._vectors[self._round & 1]
        mine[:] = vector
        if quiet:  # every rank is on its way into this round already
            ring = _lib.HL_BOARD_RING_NONE
        elif urgent:
            ring = _lib.HL_BOARD_RING_ALL
        elif mine.tobytes() != self._vectors[(self._round - 1) & 1].tobytes():
            ring = _lib.HL_BOARD_RING_BUSY
        else:
            ring = _lib.HL_BOARD_RING_NONE
        self.set_busy(idle is None)
        k = self._carried_round = self._run(watch, idle, ring)
        if self._out is None or self._out[0] is not out:  # the same array every cycle
            self._out = (out, _ffi.cast("uint64_t *", _ffi.from_buffer(out)))
        _lib.hl_board_or(*self._args, k, self._out[1])

    def post(self, items) -> List[int]:
        """Put (slot, arrays, prescale) items in the mailbox of the next control round
        (exchange_or), in order, while they fit; the slots posted. `arrays` (C-contiguous)
        are packed back to back, scaled by `prescale`."""
        p = self._round & 1
        box = self._boxes[self.rank][p]
        offset, rows = CARRY_TABLE_BYTES, []
        for slot, arrays, prescale in items:
            if len(rows) == 3 * CARRY_MAX_TENSORS:
                break
            nbytes = sum([a.nbytes for a in arrays])
            if offset + nbytes > MAILBOX_BYTES:
                continue
            if prescale == 1.0 and len(arrays) == 1:
                box[offset:offset + nbytes] = arrays[0].reshape(-1).view(np.uint8)
            else:
                kernels.pack(box[offset:offset + nbytes], arrays, prescale)
            rows += (slot, offset, nbytes)
            offset += (nbytes + 63) & ~63
        table = self._tables[p]
        if rows:
            table[1:1 + len(rows)] = rows
        table[0] = len(rows) // 3
        return rows[::3]

    def reduce_carried(self, slot: int, out: np.ndarray, dtype: int, op: int,
                       postscale: float) -> None:
        """out (C-contiguous) = every rank's bytes for `slot` in the last control round,
        reduced in rank order, then scaled by `postscale`: the same bits on every rank.
        dtype and op: kernels.native_codes."""
        rc = _lib.hl_board_reduce_carried(*self._args, self._carried_round, slot,
                                          _ffi.from_buffer(out, require_writable=True),
                                          out.nbytes, out.size, dtype, op, postscale)
        if rc:
            raise HorovodInternalError(
                f"the control board's round {self._carried_round} lacks a carried tensor "
                f"(cache slot {slot}, {out.nbytes} bytes) of some rank (error {rc})")

    def gather_bytes(self, data: bytes, root: int = 0, watch=None) -> Optional[List[bytes]]:
        """Every rank's `data` at `root` (a list in rank order; None elsewhere)."""
        return self._move(data, None, root, watch)

    def bcast_bytes(self, data: bytes, root: int = 0, watch=None) -> bytes:
        """`data` from `root` (ignored elsewhere) on every rank."""
        return self._move(data if self.rank == root else b"", root, root, watch)[root]

    def _move(self, data: bytes, sender: Optional[int], root: int, watch):
        """Rounds until every rank's `data` (or only `sender`'s) is at `root` (or, for a
        sender, at every rank). Word 0 of a rank's vector carries its total length."""
        got = {q: bytearray() for q in range(self.size)
               if sender is None and self.rank == root or q == sender}
        offset, longest = 0, None
        while True:
            p = self._round & 1
            chunk = data[offset:offset + MAILBOX_BYTES]
            vec = self._vectors[p]
            vec[:] = 0
            vec[0] = len(data)
            if chunk:
                self._boxes[self.rank][p][:len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
            self._run(watch, None)
            if longest is None:
                lengths = {q: int(self._lengths[q][p][0]) for q in range(self.size)}
                longest = max(lengths.values()) if sender is None else lengths[sender]
            for q, buf in got.items():
                take = min(MAILBOX_BYTES, lengths[q] - len(buf))
                if take > 0:
                    buf += self._boxes[q][p][:take].tobytes()
            offset += MAILBOX_BYTES
            if offset >= longest:
                break
        if sender is not None:
            return {sender: bytes(got[sender])}
        return [bytes(got[q]) for q in range(self.size)] if self.rank == root else None

    def close(self) -> None:
        """Collective with the other ranks' close. The memory stays mapped (see above)."""
        _retired.append(self._win)


def open_control_board(comm: MPI.Comm, words: int, polite: bool,
                       local: bool) -> Optional[ControlBoard]:
    """The board when `local` (every rank of `comm` on this host, the same answer on every
    rank: the shared-memory allreduce is on), else None: MPI's collectives carry the
    control exchange, as they do across hosts. Collective over `comm`."""
    return ControlBoard(comm, words, polite) if local and comm.Get_size() > 1 else None
