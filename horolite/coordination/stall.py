"""Stall inspector (rank 0): report tensors some ranks submitted and others did not."""
from __future__ import annotations

import logging
from typing import Optional

from .negotiation import Coordinator, format_ranks

__all__ = ["StallInspector"]

_log = logging.getLogger("horolite.coordination.stall")

# How often the table is inspected: a cheap walk, but no need to do it every cycle.
_INSPECT_EVERY = 0.5


class StallInspector:
    def __init__(self, warn_after: float, shutdown_after: float, where=None):
        """where(rank) -> 'rank 1 (host node2)' names the missing ranks in the shutdown message."""
        self.warn_after = warn_after
        self.shutdown_after = shutdown_after
        self._where = where or (lambda rank: f"rank {rank}")
        self._last_inspect = 0.0
        self._last_warned = {}

    def check(self, coordinator: Coordinator, now: float, rank: int) -> Optional[str]:
        """Log stalled tensors; return a shutdown message once one waits past shutdown_after."""
        if now - self._last_inspect < _INSPECT_EVERY:
            return None
        self._last_inspect = now
        # The shutdown acts at its own time, not at the next warning.
        after = min(self.warn_after, self.shutdown_after) if self.shutdown_after > 0 \
            else self.warn_after
        stalled = coordinator.stalled(now, after)
        if not stalled:
            self._last_warned.clear()
            return None
        lines = []
        for name, have, missing, waited in stalled:
            lines.append(f"tensor '{name}' waited {waited:.1f} s: submitted by {format_ranks(have)}, "
                         f"missing on {format_ranks(missing)}")
        fresh = [name for name, *_, waited in stalled if waited >= self.warn_after
                 and now - self._last_warned.get(name, -1e9) >= self.warn_after]
        if fresh:
            for name in fresh:
                self._last_warned[name] = now
            _log.warning("rank %d: stall detected: some ranks are not submitting the same "
                         "collectives (a rank may be stuck, or the ranks run different code):\n  %s",
                         rank, "\n  ".join(lines))
        if self.shutdown_after > 0:
            over = [s for s in stalled if s[3] >= self.shutdown_after]
            if over:
                parts = [f"tensor '{name}' waited {waited:.1f} s: submitted by "
                         f"{format_ranks(have)}, missing on "
                         f"{', '.join(self._where(r) for r in missing)}"
                         for name, have, missing, waited in over]
                return (f"stall shutdown after HOROLITE_STALL_SHUTDOWN_TIME_SECONDS="
                        f"{self.shutdown_after:g}: " + "; ".join(parts))
        return None
