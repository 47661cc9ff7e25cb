"""The per-cycle control message: one bitwise-OR allreduce of a small uint64 vector.

Layout: [flags, fusion threshold, cycle time in us, ready slots..., invalid slots...].
- flags: OR of every rank's flags (uncached work, shutdown, join, rank 0 must speak);
- the two settings: only rank 0 writes them, so the OR hands every rank rank 0's values;
- ready slots: each rank writes the *complement* of the response-cache slots it has
  ready, so the OR of complements is the complement of "ready on every rank";
- invalid slots: cache slots some rank wants dropped (OR).
"""
from __future__ import annotations

from typing import Collection, List, NamedTuple, Optional, Tuple

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
        self._bits = np.empty(64 * self.words, dtype=bool)  # one per slot, scratch for encode

    def encode(self, flags: int, setting: Optional[Tuple[int, float]],
               ready: Collection[int], invalid: Collection[int]) -> np.ndarray:
        """This rank's vector; `setting` (fusion bytes, cycle ms) only on rank 0."""
        vec = self.send
        vec[:] = 0
        vec[0] = flags
        if setting is not None:
            vec[1] = setting[0]
            vec[2] = int(round(setting[1] * 1000))
        if self.words:
            # One NumPy scatter per set, not a Python step per slot: a step of many
            # small gradients has hundreds of slots ready.
            bits = self._bits
            bits[:] = True
            if ready:
                bits[_slots(ready)] = False
            vec[_HEADER:_HEADER + self.words] = _pack(bits)
            if invalid:
                bits[:] = False
                bits[_slots(invalid)] = True
                vec[_HEADER + self.words:] = _pack(bits)
        return vec

    def decode(self, out: Optional[np.ndarray] = None) -> Decoded:
        """Read the OR-reduced vector (default: `received`)."""
        out = self.received if out is None else out
        w = self.words
        return Decoded(int(out[0]), int(out[1]), int(out[2]) / 1e6,
                       _bits(~out[_HEADER:_HEADER + w]) if w else [],
                       _bits(out[_HEADER + w:]) if w else [])


def _slots(slots) -> np.ndarray:
    return np.fromiter(slots, dtype=np.intp, count=len(slots))


def _pack(bits: np.ndarray) -> np.ndarray:
    """Booleans, slot s at index s, as uint64 words with slot s at bit s % 64 of word s // 64."""
    return np.packbits(bits, bitorder="little").view("<u8")


def _bits(words: np.ndarray) -> List[int]:
    """Indices of the set bits of a uint64 array, ascending."""
    if not words.any():
        return []
    return np.flatnonzero(np.unpackbits(words.astype("<u8", copy=False).view(np.uint8),
                                        bitorder="little")).tolist()
