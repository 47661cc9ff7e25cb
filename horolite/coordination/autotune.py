"""Autotune (rank 0): pick the fusion threshold and cycle time from observed bytes/s.

A coordinate search: cycle time first (with the fusion threshold held), then
the fusion threshold (with the best cycle time), each candidate scored over
a window of steady traffic; then the best setting is held. Rank 0 decides and
the runtime broadcasts its choice in the per-cycle control vector, so every
rank switches at the same cycle (fusion planning must stay identical).
Parameters the user set explicitly are never changed.
"""
from __future__ import annotations

import logging
import time
from typing import List, Optional, Tuple

from ..core.config import Config

__all__ = ["Autotuner", "parse_start"]

_log = logging.getLogger("horolite.coordination.autotune")

CYCLE_CHOICES_MS = (0.5, 1.0, 2.0, 5.0, 10.0, 25.0, 50.0)
FUSION_CHOICES = tuple(mb << 20 for mb in (1, 4, 16, 64, 128))


def parse_start(text: str) -> dict:
    """HOROLITE_AUTOTUNE_START='cycle_time_ms=50,fusion_threshold=1048576' -> dict."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        key = key.strip()
        if key not in ("cycle_time_ms", "fusion_threshold"):
            raise ValueError(f"HOROLITE_AUTOTUNE_START: unknown parameter {key!r} "
                             "(use cycle_time_ms and fusion_threshold)")
        out[key] = float(value) if key == "cycle_time_ms" else int(value)
    return out


class Autotuner:
    def __init__(self, cfg: Config, window_seconds: float = 1.0, start: Optional[dict] = None):
        start = start or {}
        self.fusion = int(start.get("fusion_threshold", cfg.fusion_threshold))
        self.cycle_ms = float(start.get("cycle_time_ms", cfg.cycle_time_ms))
        self.window = window_seconds
        self._plan: List[Tuple[str, list]] = []
        if "cycle_time_ms" not in cfg.explicit:
            self._plan.append(("cycle_ms", sorted(set(CYCLE_CHOICES_MS) | {self.cycle_ms})))
        if "fusion_threshold" not in cfg.explicit and self.fusion > 0:
            self._plan.append(("fusion", sorted(set(FUSION_CHOICES) | {self.fusion})))
        self.done = not self._plan
        self._log_file = open(cfg.autotune_log, "w") if cfg.autotune_log else None
        if self._log_file:
            self._log_file.write("time,phase,fusion_threshold,cycle_time_ms,bytes_per_second\n")
            self._log_file.flush()
        self._origin = time.monotonic()
        self._scores = {}
        self._candidates: List = []
        self._param = None
        self._window_start = None
        self._bytes = 0
        self._next_phase()

    @property
    def setting(self) -> Tuple[int, float]:
        return self.fusion, self.cycle_ms

    def _next_phase(self) -> None:
        if not self._plan:
            self.done = True
            _log.info("autotune settled: fusion threshold %d bytes, cycle time %g ms",
                      self.fusion, self.cycle_ms)
            return
        self._param, choices = self._plan.pop(0)
        current = getattr(self, self._param)
        # Start with the current value, then the others nearest first.
        self._candidates = sorted(choices, key=lambda c: (c != current, abs(c - current)))
        self._scores = {}
        self._apply(self._candidates[0])

    def _apply(self, value) -> None:
        setattr(self, self._param, value)
        self._window_start = None
        self._bytes = 0

    def observe(self, now: float, nbytes: int) -> bool:
        """Count a cycle's reduced bytes; True when the setting changed."""
        if self.done or nbytes <= 0:
            return False
        if self._window_start is None:  # the first busy cycle under a new setting opens the window
            self._window_start = now
            return False
        self._bytes += nbytes
        elapsed = now - self._window_start
        if elapsed < self.window:
            return False
        score = self._bytes / elapsed
        value = self._candidates[len(self._scores)]
        self._scores[value] = score
        self._record(score)
        if len(self._scores) < len(self._candidates):
            self._apply(self._candidates[len(self._scores)])
            return True
        best = max(self._scores, key=self._scores.get)
        self._apply(best)
        self._next_phase()
        return True

    def _record(self, score: float) -> None:
        _log.debug("autotune sample: fusion %d, cycle %g ms: %.3g B/s", self.fusion, self.cycle_ms, score)
        if self._log_file:
            self._log_file.write(f"{time.monotonic() - self._origin:.3f},{self._param},"
                                 f"{self.fusion},{self.cycle_ms:g},{score:.6g}\n")
            self._log_file.flush()

    def close(self) -> None:
        if self._log_file:
            self._log_file.close()
            self._log_file = None
