"""SyncBatchNormalization: batch normalization over the global batch (every rank's rows).

Plain BatchNormalization normalizes each rank's batch by its own mean and
variance; with small per-rank batches those statistics are noisy, and a
data-parallel run no longer computes what one process on the whole batch
would. This layer gathers every rank's per-channel count, mean and sum of
squared deviations (one allgather per layer and step) and combines them, so
every rank normalizes by the same global statistics, also when the ranks'
batches differ in size. The gather's gradient is the Sum-allreduce of the
upstream gradient (this rank's rows), so backprop is also the global batch's: training with
this layer and DistributedOptimizer equals one process with plain
BatchNormalization on the whole batch (equal batches per rank).

Inference (training=False) uses the moving statistics and communicates nothing.
"""
from __future__ import annotations

import keras
import tensorflow as tf

import horolite as _core
from horolite.elastic import in_process

from horolite.core.ops import ReduceOp

from .mpi_ops import allgather_with_gradient


__all__ = ["SyncBatchNormalization"]


@keras.saving.register_keras_serializable(package="horolite")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """keras.layers.BatchNormalization whose training statistics span all ranks (Horovod's name).

    Every rank must call the layer in training mode at the same steps, as
    with any collective; the layer's name names its allgather.
    """

    def __init__(self, fused=False, **kwargs):
        if fused:
            raise ValueError("SyncBatchNormalization does not support fused=True")
        kwargs.pop("synchronized", None)  # tf.distribute's own synchronization; not ours
        super().__init__(**kwargs)
        # Its allgather is a Python op XLA cannot compile: Keras then keeps a model holding
        # this layer off XLA, which it otherwise turns on by itself on GPU machines.
        self.supports_jit = False

    def _moments(self, inputs, mask):
        if _core.size() == 1 and not in_process.enabled():
            # (an elastic job without MPI keeps its traced steps while ranks join: there
            # a step traced at one rank must still gather, for when it is not alone)
            return super()._moments(inputs, mask)
        axes = list(self._reduction_axes)
        # Each rank's count, mean and sum of squared deviations, gathered and combined
        # as Chan et al. combine partial variances: no E[x^2] - E[x]^2 cancellation when the mean is
        # large against the spread. One allgather of 3 x channels values per rank.
        if mask is None:
            mean, var = tf.nn.moments(inputs, axes, keepdims=True)
            count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(inputs), axes)), inputs.dtype)
            count = tf.fill(tf.shape(mean), count)
        else:
            weight = tf.cast(tf.broadcast_to(tf.expand_dims(tf.cast(mask, tf.bool), -1),
                                             tf.shape(inputs)), inputs.dtype)
            count = tf.reduce_sum(weight, axis=axes, keepdims=True)
            mean = tf.math.divide_no_nan(tf.reduce_sum(inputs * weight, axis=axes, keepdims=True), count)
            var = tf.math.divide_no_nan(
                tf.reduce_sum(tf.square(inputs - mean) * weight, axis=axes, keepdims=True), count)
        local = tf.stack([tf.reshape(count, [-1]), tf.reshape(mean, [-1]),
                          tf.reshape(var * count, [-1])])
        # Every rank's loss depends on every rank's rows through these statistics: the
        # gradient sums the upstream gradients (Horovod's public allgather averages them).
        every = allgather_with_gradient(local[None], f"SyncBatchNormalization.{self.name}",
                                        ReduceOp.SUM)
        counts, means, squares = every[:, 0], every[:, 1], every[:, 2]
        total = tf.reduce_sum(counts, axis=0)
        global_mean = tf.math.divide_no_nan(tf.reduce_sum(counts * means, axis=0), total)
        spread = tf.reduce_sum(squares, axis=0) + \
            tf.reduce_sum(counts * tf.square(means - global_mean), axis=0)
        return global_mean, tf.math.divide_no_nan(spread, total)

    def get_config(self):
        config = super().get_config()
        config.pop("synchronized", None)
        return config
