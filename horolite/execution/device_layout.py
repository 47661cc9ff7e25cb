"""Where each member of a fused device collective goes, as NumPy tables for one kernel launch.

A batch of device tensors is moved by one gather launch (core/device_kernels.py)
from a table of (source pointer, start, length); the results are views of one
output buffer. Everything here is computed with NumPy vector operations, once per
batch of cached responses (they recur as the same objects every step), so the
background thread's cost per member stays that of a host batch: the only
per-member Python left is reading each input's pointer and making its view.

Members start on ALIGN-byte boundaries (cudaMalloc's), so any dtype's view is
aligned and copies can move 16 bytes at a time. Pure: no CuPy, no GPU.
"""
from __future__ import annotations

import math
from typing import Sequence, Tuple

import numpy as np

from ..core.device_kernels import COPY_UNITS
from ..transport.ring import row_bounds

__all__ = ["ALIGN", "aligned", "aligned_starts", "copy_unit", "gather_table", "Packed", "Gathered",
           "Scattered", "views"]

ALIGN = 256


def aligned(nbytes):
    """`nbytes` rounded up to ALIGN (arrays too)."""
    return (nbytes + (ALIGN - 1)) // ALIGN * ALIGN


def aligned_starts(nbytes: np.ndarray, axis: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """Byte starts of members laid out one after the other along `axis`, each on an ALIGN
    boundary, and where the last one ends."""
    nbytes = np.asarray(nbytes, dtype=np.int64)
    padded = aligned(nbytes)
    starts = np.cumsum(padded, axis=axis) - padded
    ends = np.take(starts + nbytes, [-1], axis=axis).squeeze(axis) if nbytes.shape[axis] else \
        np.zeros(np.delete(nbytes.shape, axis), np.int64)
    return starts, ends


def copy_unit(*arrays) -> int:
    """The widest unit (16, 8, 4, 2 or 1 bytes) that divides every pointer, start and length."""
    bits = 0
    for a in arrays:
        a = np.asarray(a)
        if a.size:
            bits |= int(np.bitwise_or.reduce(a.astype(np.uint64, copy=False).ravel()))
    for unit in COPY_UNITS:
        if bits % unit == 0:
            return unit
    return 1


def gather_table(ptrs: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The kernel's table: n source pointers, n starts, n lengths (int64; starts ascending)."""
    n = len(ptrs)
    table = np.empty(3 * n, dtype=np.int64)
    table[:n] = np.asarray(ptrs, dtype=np.uint64).view(np.int64)
    table[n:2 * n] = starts
    table[2 * n:] = counts
    return table


def views(buf, shapes: Sequence[tuple], dtypes: Sequence, starts: Sequence[int]) -> list:
    """CuPy arrays over `buf`'s memory, one per (shape, dtype, byte start): no copy, no
    allocation; each keeps the buffer alive."""
    import cupy
    base, ndarray = buf.data, cupy.ndarray
    return [ndarray(shape, dtype, base + start) for shape, dtype, start in zip(shapes, dtypes, starts)]


class Packed:
    """Members laid out one after the other in one buffer (allreduce, broadcast)."""
    __slots__ = ("shapes", "dtypes", "nbytes", "starts", "total", "_starts", "single_dtype")

    def __init__(self, shapes: Sequence[tuple], dtypes: Sequence[np.dtype]):
        self.shapes = [tuple(s) for s in shapes]
        self.dtypes = [np.dtype(d) for d in dtypes]
        self.single_dtype = self.dtypes[0] if len(set(self.dtypes)) == 1 else None
        self.nbytes = np.array([math.prod(s) * d.itemsize for s, d in zip(self.shapes, self.dtypes)],
                               dtype=np.int64)
        self.starts, end = aligned_starts(self.nbytes)
        self.total = int(end)
        self._starts = self.starts.tolist()

    def table(self, ptrs: np.ndarray, unit: int) -> np.ndarray:
        return gather_table(ptrs, self.starts // unit, self.nbytes // unit)

    def views(self, buf) -> list:
        return views(buf, self.shapes, self.dtypes, self._starts)


class Gathered:
    """An allgather of several tensors: each rank packs its parts into its segment of one
    buffer (equal segments, so one NCCL allGather), then one launch unpacks the segments
    into one result buffer, member after member, each member's parts in rank order."""

    def __init__(self, shapes: Sequence[tuple], dtypes: Sequence[np.dtype],
                 first_dims: Sequence[Sequence[int]], rank: int):
        self.dtypes = [np.dtype(d) for d in dtypes]
        rows = np.array([math.prod(s[1:]) * d.itemsize for s, d in zip(shapes, self.dtypes)],
                        dtype=np.int64)
        dims = np.array(first_dims, dtype=np.int64).reshape(len(rows), -1)  # member x rank
        size = dims.shape[1]
        part = dims * rows[:, None]
        seg_starts, seg_ends = aligned_starts(part, axis=0)
        self.segment = int(aligned(seg_ends.max())) if part.size else 0
        self.pack_starts = seg_starts[:, rank].copy()
        self.pack_bytes = part[:, rank].copy()
        result_bytes = part.sum(axis=1)
        result_starts, end = aligned_starts(result_bytes)
        self.total = int(end)
        self.unpack_src = (np.arange(size, dtype=np.int64) * self.segment + seg_starts).ravel()
        self.unpack_dst = (result_starts[:, None] + np.cumsum(part, axis=1) - part).ravel()
        self.unpack_bytes = part.ravel()
        self.shapes = [(int(d.sum()),) + tuple(s[1:]) for d, s in zip(dims, shapes)]
        self._starts = result_starts.tolist()
        self.unpack_unit = copy_unit(self.segment, self.unpack_src, self.unpack_dst,
                                     self.unpack_bytes)

    def pack_table(self, ptrs: np.ndarray, unit: int) -> np.ndarray:
        return gather_table(ptrs, self.pack_starts // unit, self.pack_bytes // unit)

    def unpack_table(self, gathered_ptr: int) -> np.ndarray:
        unit = self.unpack_unit
        return gather_table(np.uint64(gathered_ptr) + self.unpack_src.astype(np.uint64),
                            self.unpack_dst // unit, self.unpack_bytes // unit)

    def views(self, buf) -> list:
        return views(buf, self.shapes, self.dtypes, self._starts)


class Scattered:
    """A reducescatter of several tensors of one dtype: one launch packs (scaled) every
    member's part for rank j into segment j of one buffer (equal segments, so one NCCL
    reduceScatter); this rank's segment then holds every member's result."""

    def __init__(self, shapes: Sequence[tuple], dtype: np.dtype, size: int, rank: int):
        self.dtype = np.dtype(dtype)
        item = self.dtype.itemsize
        bounds, my_rows = [], []
        for s in shapes:
            rows = s[0] if s else 1
            row_elems = math.prod(s[1:]) if s else 1
            bounds.append(row_bounds(rows, row_elems, size))
            base, extra = divmod(rows, size)
            my_rows.append(base + (1 if rank < extra else 0))
        bounds = np.array(bounds, dtype=np.int64).reshape(len(shapes), size + 1)
        part = np.diff(bounds, axis=1) * item  # member x rank, bytes
        seg_starts, seg_ends = aligned_starts(part, axis=0)
        self.segment = int(aligned(seg_ends.max())) if part.size else 0  # bytes
        # pieces in order of their start: rank after rank, members in order within a rank
        self.dst = (np.arange(size, dtype=np.int64)[:, None] * self.segment + seg_starts.T).ravel()
        self.src_offsets = (bounds[:, :-1] * item).T.ravel()
        self.piece_bytes = part.T.ravel()
        self.members = len(shapes)
        self.shapes = [(r,) + tuple(s[1:]) for r, s in zip(my_rows, shapes)]
        self._starts = seg_starts[:, rank].tolist()

    def sources(self, ptrs: np.ndarray) -> np.ndarray:
        """Each piece's source pointer, from the members' input pointers (0 stays 0)."""
        src = np.tile(np.asarray(ptrs, dtype=np.uint64), len(self.dst) // max(self.members, 1))
        return np.where(src == 0, np.uint64(0), src + self.src_offsets.astype(np.uint64))

    def table(self, src: np.ndarray, unit: int) -> np.ndarray:
        return gather_table(src, self.dst // unit, self.piece_bytes // unit)

    def views(self, buf) -> list:
        return views(buf, self.shapes, [self.dtype] * len(self.shapes), self._starts)
