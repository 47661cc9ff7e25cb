"""The per-cycle control message: one bitwise-OR allreduce of a small uint64 vector.

Layout: [flags, fusion threshold, cycle time in us, ready slots..., invalid slots...,
carried slots...].
- flags: OR of every rank's flags (uncached work, shutdown, join, rank 0 must speak,
  rank 0 asks for the straggler record);
- the two settings: only rank 0 writes them, so the OR hands every rank rank 0's values;
- ready slots: each rank writes the *complement* of the response-cache slots it has
  ready, so the OR of complements is the complement of "ready on every rank";
- invalid slots: cache slots some rank wants dropped (OR);
- carried slots: ready slots whose bytes the rank put in this round's mailbox
  (execution/carried.py), as complements like the ready ones: the slots every
  rank carried are reduced from the mailboxes, with no exchange of their own.
"""
from __future__ import annotations

from typing import Collection, List, NamedTuple, Optional, Tuple

import numpy as np

__all__ = ["ControlVector", "Decoded", "HAS_UNSENT", "SHUTDOWN", "JOINED", "COORDINATOR",
           "STRAGGLERS"]

HAS_UNSENT = 1
SHUTDOWN = 2
JOINED = 4
COORDINATOR = 8
STRAGGLERS = 16  # rank 0 asks for the straggler record's ages (straggler_round.py)

_HEADER = 3
_ALL_ONES = (1 << 64) - 1
_FEW = 32  # slots below which setting bits in Python beats a NumPy scatter


class Decoded(NamedTuple):
    flags: int
    fusion_threshold: int
    cycle_seconds: float
    ready: List[int]      # cache slots every rank has ready, ascending
    invalid: List[int]    # cache slots some rank invalidated, ascending
    carried: List[int]    # ready slots whose bytes every rank carried this round, ascending


class ControlVector:
    def __init__(self, cache_capacity: int):
        self.words = (cache_capacity + 63) // 64
        self.send = np.zeros(_HEADER + 3 * self.words, dtype=np.uint64)
        self.received = np.zeros_like(self.send)
        self._bits = np.empty(64 * self.words, dtype=bool)  # one per slot, scratch for encode
        # A step that repeats sends and receives the same vectors cycle after cycle: the
        # last of each is kept and reused (encoding and decoding cost 7-12 us of Python).
        self._sent_key = None
        self._received = (None, None)

    def encode(self, flags: int, setting: Optional[Tuple[int, float]],
               ready: Collection[int], invalid: Collection[int],
               carried: Collection[int] = ()) -> np.ndarray:
        """This rank's vector; `setting` (fusion bytes, cycle ms) only on rank 0;
        `carried` a subset of `ready`."""
        key = (flags, setting, tuple(ready), tuple(invalid), tuple(carried))
        vec = self.send
        if key == self._sent_key:
            return vec  # the same as last cycle's, still in `send`
        self._sent_key = None
        vec[:] = 0
        vec[0] = flags
        if setting is not None:
            vec[1] = setting[0]
            vec[2] = int(round(setting[1] * 1000))
        w = self.words
        if w:
            vec[_HEADER:_HEADER + w] = self._words(ready, True)
            if invalid:
                vec[_HEADER + w:_HEADER + 2 * w] = self._words(invalid, False)
            vec[_HEADER + 2 * w:] = self._words(carried, True)
        self._sent_key = key
        return vec

    def _words(self, slots: Collection[int], complement: bool):
        """The bitmap of `slots` (or its complement) as uint64 words."""
        if len(slots) > _FEW:
            # One NumPy scatter, not a Python step per slot: a step of many small
            # gradients has hundreds of slots ready.
            bits = self._bits
            bits[:] = complement
            bits[np.fromiter(slots, dtype=np.intp, count=len(slots))] = not complement
            return np.packbits(bits, bitorder="little").view("<u8")
        if complement:
            words = [_ALL_ONES] * self.words
            for slot in slots:
                words[slot >> 6] &= ~(1 << (slot & 63))
        else:
            words = [0] * self.words
            for slot in slots:
                words[slot >> 6] |= 1 << (slot & 63)
        return words

    def decode(self, out: Optional[np.ndarray] = None) -> Decoded:
        """Read the OR-reduced vector (default: `received`). A vector equal to the last
        one decoded gives the same Decoded back: its lists are shared, never modify them."""
        out = self.received if out is None else out
        raw = out.tobytes()
        last_raw, last = self._received
        if raw == last_raw:
            return last
        w = self.words
        decoded = Decoded(int(out[0]), int(out[1]), int(out[2]) / 1e6,
                          _bits(~out[_HEADER:_HEADER + w]) if w else [],
                          _bits(out[_HEADER + w:_HEADER + 2 * w]) if w else [],
                          _bits(~out[_HEADER + 2 * w:]) if w else [])
        self._received = (raw, decoded)
        return decoded


def _bits(words: np.ndarray) -> List[int]:
    """Indices of the set bits of a uint64 array, ascending (slots are handed out
    lowest first, so many ready slots mostly fill whole words)."""
    out = []
    for w, word in enumerate(words.tolist()):
        if not word:
            continue
        if word == _ALL_ONES:
            out.extend(range(w * 64, w * 64 + 64))
            continue
        while word:
            low = word & -word
            out.append(w * 64 + low.bit_length() - 1)
            word ^= low
    return out
