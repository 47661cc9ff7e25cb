"""How long the background thread rests between cycles.

A cycle costs Python time on every rank, so a rank with nothing to do should not
spin through them; but once any rank has work, the others must come at once.
The rest is a wait on the runtime's wake-up (core/wake.py), which a submit rings,
and which, through the shared-memory board, a peer entering a round with news
rings too: so on one host no rank rests while another waits on it.
"""
from __future__ import annotations

import time

__all__ = ["Pacing", "IDLE_MAX_SECONDS"]

# Longest rest between cycles while this rank has nothing in flight.
IDLE_MAX_SECONDS = 0.1


class Pacing:
    def __init__(self, queue, board, quorum):
        self.queue, self.board, self.quorum = queue, board, quorum
        # Whether this rank has work a cycle must move on (the runtime's: work in the
        # exchange lane alone needs no cycles, execution/lane.py).
        self.waiting = queue.has_inflight
        self._idle_cycles = 0

    def rest(self, start: float, cycle_seconds: float) -> None:
        """Wait after the cycle that began at `start` until the next one is due, or
        until work arrives."""
        inflight = self.waiting()
        if self.board is not None:
            self.board.set_busy(inflight)
        if inflight:
            # Work is waiting on other ranks: space the cycles out, but start at once
            # when new work arrives (a tight loop submits while we run), or when a
            # peer brings new work (the board rings this rank).
            self._idle_cycles = 0
            remaining = cycle_seconds - (time.monotonic() - start)
            if remaining > 0:
                self.queue.wake.wait(remaining)
            return
        # Nothing in flight here, so no other rank can be waiting on this one until it
        # submits (and submitting wakes us): after a couple of cycles, back off to
        # IDLE_MAX_SECONDS; a cycle starts as soon as work arrives. (Not while quorum
        # allreduces run: they need this rank without its work. Through the board a
        # peer that needs this rank rings it: at once.)
        self._idle_cycles += 1
        # (Work in the exchange lane alone: no quick cycles either, nobody needs them.)
        quick = self._idle_cycles <= 2 and self.board is None and not self.queue.has_inflight()
        pause = (cycle_seconds if quick or self.quorum.active(start)
                 else max(cycle_seconds, IDLE_MAX_SECONDS))
        self.queue.wake.wait(max(pause - (time.monotonic() - start), 0))
