"""Adasum (Horovod's adaptive summation): a recursive pairwise reduction.

Two vectors a and b combine as

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

(a coefficient stays 1 where its vector's squared norm is below sqrt(DBL_MIN), as in
Horovod): orthogonal gradients add, parallel ones average. Over 2^k ranks the pairs
form a binary tree: at level l, rank r and rank r ^ 2^l combine, the group holding the
lower ranks as a. Each rank sends its whole current vector to its partner at every
level (recursive doubling) and both compute the same combination, in the same order,
so every rank ends with the same bits without a final gather. A fused batch is
combined per tensor: each tensor has its own coefficients, as Horovod's per-layer
Adasum does. Dot products and norms accumulate in float64, as Horovod's; the scaled
sum is computed in the tensor's precision (float16 in float32).
"""
from __future__ import annotations

import sys
from typing import Sequence

import numpy as np

__all__ = ["ADASUM_DTYPES", "is_power_of_two", "adasum_allreduce", "combine"]

ADASUM_DTYPES = ("float16", "float32", "float64")
SQRT_DBL_MIN = float(np.sqrt(sys.float_info.min))
_CHUNK = 1 << 15  # float16 elements converted to float32 at a time (stays in cache)


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _dots(a: np.ndarray, b: np.ndarray):
    """(a.b, |a|^2, |b|^2) accumulated in float64 (einsum converts in small buffers: no
    float64 copy of the tensor, and about the speed of a float32 dot)."""
    def dot(x, y):
        return float(np.einsum("i,i->", x, y, dtype=np.float64))
    return dot(a, b), dot(a, a), dot(b, b)


def _scaled_add(a: np.ndarray, ac: float, b: np.ndarray, bc: float, out: np.ndarray) -> None:
    """out = ac * a + bc * b in the tensors' precision (float16 through float32); `out`
    may be `a` or `b`."""
    if a.dtype != np.float16:
        ac, bc = a.dtype.type(ac), a.dtype.type(bc)
        tmp = np.multiply(b, bc)
        np.multiply(a, ac, out=out)
        out += tmp
        return
    for lo in range(0, a.size, _CHUNK):
        hi = lo + _CHUNK
        x = a[lo:hi].astype(np.float32)
        x *= np.float32(ac)
        x += b[lo:hi].astype(np.float32) * np.float32(bc)
        out[lo:hi] = x


def combine(a: np.ndarray, b: np.ndarray, out: np.ndarray, counts: Sequence[int]) -> None:
    """out = adasum(a, b) for each tensor of a fused batch (1-D arrays; `counts` are the
    tensors' element counts, in order). `out` may be `a` or `b`."""
    offset = 0
    for n in counts:
        sa, sb, so = a[offset:offset + n], b[offset:offset + n], out[offset:offset + n]
        offset += n
        if n == 0:
            continue
        dot, na, nb = _dots(sa, sb)
        ac = 1.0 - dot / na * 0.5 if na >= SQRT_DBL_MIN else 1.0
        bc = 1.0 - dot / nb * 0.5 if nb >= SQRT_DBL_MIN else 1.0
        _scaled_add(sa, ac, sb, bc, so)


def adasum_allreduce(link, buf: np.ndarray, counts: Sequence[int]) -> None:
    """Replace `buf` (1-D, this rank's fused tensors) by the Adasum of every rank's, over
    `link` (transport.mpi.PointToPoint: its waits hear of failed peers). The number of
    ranks is a power of two (the caller checked)."""
    rank, size = link.rank, link.size
    if size == 1 or buf.size == 0:
        return
    other = np.empty_like(buf)
    level = 1
    while level < size:
        partner = rank ^ level
        link.sendrecv(buf, other, dest=partner, source=partner)
        if rank & level:  # the partner's group holds the lower ranks: it is a
            combine(other, buf, buf, counts)
        else:
            combine(buf, other, buf, counts)
        level <<= 1
