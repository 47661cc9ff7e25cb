"""Reduction, scaling and fusion-buffer packing kernels.

The interface the ring and fusion code call. Arrays are 1-D and C-contiguous;
`acc` and `src` have the same dtype and length.
"""
from __future__ import annotations

import numpy as np

from .ops import ReduceOp

__all__ = ["reduce_into", "scale_into", "pack", "unpack"]


def reduce_into(acc: np.ndarray, src: np.ndarray, op: ReduceOp, postscale: float = 1.0) -> None:
    """acc = (acc op src) * postscale, in one pass."""
    if op in (ReduceOp.SUM, ReduceOp.AVERAGE):
        np.add(acc, src, out=acc)
    elif op == ReduceOp.MIN:
        np.minimum(acc, src, out=acc)
    elif op == ReduceOp.MAX:
        np.maximum(acc, src, out=acc)
    elif op == ReduceOp.PRODUCT:
        np.multiply(acc, src, out=acc)
    else:
        raise ValueError(f"unsupported reduce op {op!r}")
    if postscale != 1.0:
        scale_into(acc, acc, postscale)


def scale_into(dst: np.ndarray, src: np.ndarray, factor: float) -> None:
    """dst = src * factor (dst may be src); integers truncate toward zero."""
    if dst.dtype.kind == "f" or dst.dtype.name == "bfloat16":
        np.multiply(src, dst.dtype.type(factor), out=dst, casting="unsafe")
    else:
        dst[...] = np.trunc(src * factor)


def pack(buffer: np.ndarray, arrays, factor: float = 1.0) -> int:
    """Copy `arrays` back to back into the uint8 `buffer`; returns bytes used."""
    offset = 0
    for a in arrays:
        n = a.nbytes
        view = buffer[offset:offset + n].view(a.dtype)
        if factor != 1.0:
            scale_into(view, a.reshape(-1), factor)
        else:
            view[...] = a.reshape(-1)
        offset += n
    return offset


def unpack(buffer: np.ndarray, arrays) -> None:
    """Copy consecutive bytes of the uint8 `buffer` into each array."""
    offset = 0
    for a in arrays:
        n = a.nbytes
        a.reshape(-1)[...] = buffer[offset:offset + n].view(a.dtype)
        offset += n
