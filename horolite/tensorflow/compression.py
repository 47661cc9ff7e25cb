"""Gradient compression: what travels on the wire (Horovod's `Compression`)."""
from __future__ import annotations

import tensorflow as tf

__all__ = ["Compression", "Compressor", "NoneCompressor", "FP16Compressor"]


class Compressor:
    """compress(tensor) -> (tensor, ctx); decompress(tensor, ctx) -> tensor."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Floating tensors travel as float16 and come back in their own dtype."""

    @staticmethod
    def compress(tensor):
        dtype = tensor.dtype
        if dtype.is_floating and dtype != tf.float16:
            tensor = tf.cast(tensor, tf.float16)
        return tensor, dtype

    @staticmethod
    def decompress(tensor, ctx):
        if ctx is not None and tensor.dtype != ctx:
            tensor = tf.cast(tensor, ctx)
        return tensor


class Compression:
    none = NoneCompressor
    fp16 = FP16Compressor
