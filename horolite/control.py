"""The per-cycle control message: one bitwise-OR allreduce of a small uint64 vector.

Layout: [flags, fusion threshold, cycle time in us, ready slots..., invalid slots...].
- flags: OR of every rank's flags (uncached work, shutdown, join, rank 0 must speak);
- the two settings: only rank 0 writes them, so the OR hands every rank rank 0's values;
- ready slots: each rank writes the *complement* of the response-cache slots it has
  ready, so the OR of complements is the complement of "ready on every rank";
- invalid slots: cache slots some rank wants dropped (OR).
"""
from __future__ import annotations

from typing import Iterable, List, NamedTuple, Optional, Tuple

import numpy as np

__all__ = ["ControlVector", "Decoded", "HAS_UNSENT", "SHUTDOWN", "JOINED", "COORDINATOR"]

HAS_UNSENT = 1
SHUTDOWN = 2
JOINED = 4
COORDINATOR = 8

_HEADER = 3
_ALL_ONES = (1 << 64) - 1


class Decoded(NamedTuple):
    flags: int
    fusion_threshold: int
    cycle_seconds: float
    ready: List[int]      # cache slots every rank has ready, ascending
    invalid: List[int]    # cache slots some rank invalidated, ascending


class ControlVector:
    def __init__(self, cache_capacity: int):
        self.words = (cache_capacity + 63) // 64
        self.send = np.zeros(_HEADER + 2 * self.words, dtype=np.uint64)
        self.received = np.zeros_like(self.send)

    def encode(self, flags: int, setting: Optional[Tuple[int, float]],
               ready: Iterable[int], invalid: Iterable[int]) -> np.ndarray:
        """This rank's vector; `setting` (fusion bytes, cycle ms) only on rank 0."""
        vec = self.send
        vec[:] = 0
        vec[0] = flags
        if setting is not None:
            vec[1] = setting[0]
            vec[2] = int(round(setting[1] * 1000))
        if self.words:
            # Bits are set in Python ints, then stored once: numpy scalar ops per slot cost more.
            words = [_ALL_ONES] * self.words
            for slot in ready:
                words[slot >> 6] &= ~(1 << (slot & 63))
            vec[_HEADER:_HEADER + self.words] = words
            words = [0] * self.words
            for slot in invalid:
                words[slot >> 6] |= 1 << (slot & 63)
            vec[_HEADER + self.words:] = words
        return vec

    def decode(self, out: Optional[np.ndarray] = None) -> Decoded:
        """Read the OR-reduced vector (default: `received`)."""
        out = self.received if out is None else out
        w = self.words
        return Decoded(int(out[0]), int(out[1]), int(out[2]) / 1e6,
                       _bits(~out[_HEADER:_HEADER + w]) if w else [],
                       _bits(out[_HEADER + w:]) if w else [])


def _bits(words: np.ndarray) -> List[int]:
    """Indices of the set bits of a uint64 array, ascending."""
    out = []
    for w, word in enumerate(words.tolist()):
        while word:
            low = word & -word
            out.append(w * 64 + low.bit_length() - 1)
            word ^= low
    return out
