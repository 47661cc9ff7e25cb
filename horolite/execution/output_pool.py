"""Where results of 64 KiB or more live: arrays kept and handed out again once nothing
refers to them, so that a step's results do not pay fresh pages' faults every time."""
from __future__ import annotations

import math
import mmap
import sys
import threading

import numpy as np

__all__ = ["OutputPool"]


class OutputPool:
    """Result arrays of >= 64 KiB, reused once the caller has dropped them.

    A fresh np.empty of many MiB is a new mmap whose first touch faults and
    zeroes every page: at 64 MiB that costs more than the copy into it. The
    pool keeps the last few results per dtype and hands one out again
    only when nothing but the pool refers to it (a view or a buffer export
    holds a reference, so an array still in use is never reused).
    With a result arena (transport/result_arena.py) the arrays it keeps come
    from there, so the shared-memory allreduce can write them directly; else
    they are page-aligned private arrays. (api/grouping.py keeps a second pool,
    for the buffers of grouped allreduces too small to be packed into this one.)
    """
    MIN_BYTES = 64 << 10
    # A caller that keeps the last two steps' results (a framework applying them while
    # the next step runs) holds two of each; the step in flight needs a third, and one
    # more keeps the reuse from ever falling back to fresh pages when a result is
    # released a moment late. Fresh pages cost more than the allreduce that fills them.
    # So up to 32 arrays per dtype: four of each of a step's few result sizes.
    MAX_ARRAYS = 32
    # What the pool may hold in all: beyond it, results are plain new arrays (a
    # BERT-base step is 438 MB, and its caller may hold two).
    MAX_BYTES = 2 << 30

    def __init__(self, arena=None):
        self._arrays = {}
        self._held = 0
        self.arena = arena
        # The background thread takes results here, callers the buffers they pack
        # groups into (grouping.py), so that a group is reduced in place.
        self._lock = threading.Lock()

    def empty(self, shape, dtype) -> np.ndarray:
        count = math.prod(shape)
        nbytes = count * dtype.itemsize
        if nbytes < self.MIN_BYTES:
            return np.empty(shape, dtype=dtype)
        with self._lock:
            return self._pooled(shape, dtype, count, nbytes)

    def _pooled(self, shape, dtype, count: int, nbytes: int) -> np.ndarray:
        # Handed out as a view of the first `count` elements of the smallest free kept
        # array that holds them (at most twice as large): a fused batch's size changes
        # from step to step (which tensors arrived in which cycle), and kept by exact
        # shape every new size was a fresh array.
        best = None
        for a in self._arrays.get(dtype, ()):
            if count <= a.size <= 2 * count and (best is None or a.size < best.size) and \
                    sys.getrefcount(a) <= 3:  # the list, `a`, and getrefcount's argument
                best = a
        kept = self._arrays.setdefault(dtype, [])
        if best is not None:
            _remove(kept, best)
            kept.append(best)  # the least recently used come first
            return best[:count].reshape(shape)
        size = _size_class(nbytes)
        if len(kept) >= self.MAX_ARRAYS or self._held + size > self.MAX_BYTES:
            self._evict(kept, size)
        if len(kept) < self.MAX_ARRAYS and self._held + size <= self.MAX_BYTES:
            n = size // dtype.itemsize
            a = self.arena.empty((n,), dtype) if self.arena is not None else None
            if a is None:
                a = _page_aligned_empty((n,), dtype, size)
            kept.append(a)
            self._held += size
            return a[:count].reshape(shape)  # (a view's base is `a`: it counts there)
        return _page_aligned_empty(shape, dtype, nbytes)

    def _evict(self, kept: list, size: int) -> None:
        """Forget free arrays, least recently used first, when that makes room for one
        of `size` bytes more in `kept`: what a job reduces may change (another model,
        evaluation), and a full pool of old sizes would leave every new result on
        fresh pages. Nothing is forgotten when no room can be made."""
        free = [(arrays, a) for arrays in self._arrays.values() for a in arrays
                if sys.getrefcount(a) <= 3]  # the list, `a`, getrefcount's argument
        count, held, chosen = len(kept), self._held, []
        for arrays, a in free:
            if count < self.MAX_ARRAYS and held + size <= self.MAX_BYTES:
                break
            chosen.append((arrays, a))
            held -= a.nbytes
            count -= arrays is kept
        if count >= self.MAX_ARRAYS or held + size > self.MAX_BYTES:
            return
        for arrays, a in chosen:
            _remove(arrays, a)
            self._held -= a.nbytes
            if self.arena is not None and self.arena.owns(a):
                self.arena.release(a)


def _remove(arrays: list, a: np.ndarray) -> None:
    """list.remove by identity (== on arrays compares elements)."""
    del arrays[next(i for i, x in enumerate(arrays) if x is a)]


def _size_class(nbytes: int) -> int:
    """nbytes rounded up to one of 8-16 sizes per power of two (whole pages): at most
    12.5% larger."""
    step = 1 << max(nbytes.bit_length() - 4, 12)
    return -(-nbytes // step) * step


def _page_aligned_empty(shape, dtype, nbytes: int) -> np.ndarray:
    """An array on pages of its own. np.empty's data sits 16 bytes past a 64-byte
    boundary, and TensorFlow copies every NumPy result that is not 64-byte aligned.
    Made directly on the mapping (not a view of another array), so views of it
    count in its reference count, which the pool's reuse check reads."""
    mm = mmap.mmap(-1, max(nbytes, 1))
    if nbytes >= (2 << 20) and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)  # as NumPy does for its large arrays
        except OSError:
            pass
    return np.ndarray(shape, dtype=dtype, buffer=mm)
