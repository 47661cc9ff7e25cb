"""Eager collectives' edges: whether a tape records them, and their results as tensors.

Eagerly, the cost of a collective on 4 KiB is TensorFlow's, not the exchange's:
`tf.custom_gradient` inspects the function and records on every call, and
`tf.convert_to_tensor` copies a NumPy result for ~50 us. These skip both where
they can (the bridge's eager path, bridge._run).
"""
from typing import Sequence

import numpy as np
import tensorflow as tf

__all__ = ["recording", "eager_tensor"]


def recording(tensors: Sequence[tf.Tensor]) -> bool:
    """Whether a gradient tape records an op on these tensors: eagerly, a collective
    without one needs no tf.custom_gradient around it (which inspects the function's
    signature and records on every call: most of an eager collective's cost)."""
    if not tf.executing_eagerly():
        return True
    try:
        from tensorflow.python.eager import record
    except ImportError:
        return True
    return record.should_record_backprop(list(tensors))


def eager_tensor(array: np.ndarray) -> tf.Tensor:
    """An eager tensor of a host result: on the result's own memory (through DLPack, which
    holds the array until the tensor is gone) when it is 64-byte aligned, as TensorFlow
    requires, else on a 64-byte aligned copy. tf.convert_to_tensor copies too, but costs
    ~50 us even for 4 KiB (DLPack: 2 us, the copy: 2 us)."""
    if array.size and array.dtype.kind in "fiub" and array.dtype.isnative:
        if array.ctypes.data % 64 or not array.flags.c_contiguous:
            array = _aligned_copy(array)
        try:
            return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
        except Exception:  # noqa: BLE001 - a dtype DLPack cannot carry: copied below
            pass
    return tf.convert_to_tensor(array)


def _aligned_copy(array: np.ndarray) -> np.ndarray:
    raw = np.empty(array.nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    out = raw[start:start + array.nbytes].view(array.dtype).reshape(array.shape)
    out[...] = array
    return out
