"""Reduction operations and the dtypes the runtime moves, with Horovod's names."""
from __future__ import annotations

import enum

import numpy as np

__all__ = ["ReduceOp", "Average", "Sum", "Adasum", "Min", "Max", "Product",
           "dtype_name", "dtype_from_name", "REDUCIBLE_DTYPES", "MOVABLE_DTYPES"]


class ReduceOp(enum.IntEnum):
    # Values follow Horovod's so pickled or logged ops read the same.
    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT

# Dtypes the reductions support, by canonical name. Code numbers are the ones
# native/kernels.h uses.
REDUCIBLE_DTYPES = {
    "uint8": 0, "int8": 1, "int32": 2, "int64": 3,
    "float16": 4, "bfloat16": 5, "float32": 6, "float64": 7,
    "uint16": 8, "int16": 9,
}
# Allgather, broadcast and alltoall only move bytes, so bool is fine there.
MOVABLE_DTYPES = dict(REDUCIBLE_DTYPES, bool=10)


_NAMES = {}


def dtype_name(dtype) -> str:
    """Canonical name of a NumPy dtype (bfloat16 comes from ml_dtypes); cached, since
    numpy computes `dtype.name` in Python on every access."""
    try:
        return _NAMES[dtype]
    except (KeyError, TypeError):
        name = np.dtype(dtype).name
        try:
            _NAMES[dtype] = name
        except TypeError:
            pass
        return name


def dtype_from_name(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes  # shipped with TensorFlow and JAX
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)
