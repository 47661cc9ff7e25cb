"""Helpers the TensorFlow rank-side tests share: each rank's known input, and one call
run eagerly, in tf.function or in a TF1 graph."""
import os

import numpy as np
import tensorflow as tf

MODES = ["eager", "function", "graph"]
# Which wait op the ranks must use, as the driver set it: HOROLITE_TF_NATIVE_OPS=0 in the
# fallback run, else the native op, which must have built (tests/test_tf_native_op.py
# fails the suite where it cannot be built): never whatever happened to load.
NATIVE = os.environ.get("HOROLITE_TF_NATIVE_OPS", "1").strip().lower() not in ("0", "false", "no", "off")


def value(r, shape=(2, 3), dtype=np.float32):
    """Rank r's input: a known function of r, so every result has a NumPy reference."""
    return (np.arange(int(np.prod(shape))).reshape(shape) + 10 * r).astype(dtype)


def run(mode, fn, *inputs):
    """Call fn on tensors made from the NumPy inputs in one of the three modes; NumPy results."""
    if mode == "eager":
        out = fn(*[tf.constant(a) for a in inputs])
        return tf.nest.map_structure(lambda t: t.numpy(), out)
    if mode == "function":
        out = tf.function(fn)(*[tf.constant(a) for a in inputs])
        return tf.nest.map_structure(lambda t: t.numpy(), out)
    with tf.Graph().as_default():
        outs = fn(*[tf.constant(a) for a in inputs])
        with tf.compat.v1.Session() as sess:
            return sess.run(outs)
