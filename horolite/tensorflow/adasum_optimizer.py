"""`DistributedOptimizer(tf.compat.v1.train.Optimizer, op=Adasum)`: Adasum of the model's
change, not of the gradients (Horovod's delta-based Adasum optimizer).

Each rank applies its own gradients with the wrapped optimizer (momentum and the
learning rate act locally first); every `backward_passes_per_step`-th application is a
communication step: the change since the last one, delta = var - start, is reduced
with Adasum over all ranks, and start += that, var = start on every rank. The other
applications move only this rank's variables. The starting point is taken at the first
application (after any broadcast of the initial weights).

This is what Horovod's `_DistributedAdasumOptimizer._apply_shared` describes and its
user guide documents. In Horovod 0.28.1 that wrapper's `apply_gradients` hands the
gradients straight to the wrapped optimizer, so the exchange there never runs; horolite
runs it.
"""
from __future__ import annotations

import tensorflow as tf

from .compression import Compression

__all__ = ["DistributedAdasumOptimizer"]


class DistributedAdasumOptimizer(tf.compat.v1.train.Optimizer):
    """Wraps a tf.compat.v1.train.Optimizer: local steps, Adasum of their sum of changes."""

    def __init__(self, optimizer, name=None, use_locking=False, compression=Compression.none,
                 backward_passes_per_step=1):
        if name is None:
            name = f"DistributedDelta{type(optimizer).__name__}"
        super().__init__(name=name, use_locking=use_locking)
        self._optimizer = optimizer
        self._compression = compression or Compression.none
        self._passes = int(backward_passes_per_step)
        if self._passes < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        self._step = None  # int64 count of applications, made with the first one

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's gradients, as they are (the changes are reduced, later)."""
        return self._optimizer.compute_gradients(*args, **kwargs)

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """Apply locally; on a communication step, reduce the change since the last one."""
        grads_and_vars = list(grads_and_vars)
        variables = [v for g, v in grads_and_vars if g is not None]
        if not variables:
            raise ValueError(f"{self.get_name()}: no gradients for any variable")
        if self._step is None:
            self._step = tf.Variable(0, dtype=tf.int64, trainable=False,
                                     name=f"{self.get_name()}_step_count")
        # Zeros at first (an initializer reading `v` could run before v's own): the first
        # application copies the weights in.
        starts = [self._zeros_slot(v, "delta_start", self.get_name()) for v in variables]
        first = tf.equal(self._step, 0)
        communicate = tf.equal(self._step % self._passes, self._passes - 1)

        def take_start():
            with tf.control_dependencies([s.assign(v, use_locking=self._use_locking)
                                          for s, v in zip(starts, variables)]):
                return tf.constant(True)

        started = tf.cond(first, take_start, lambda: tf.constant(False))
        with tf.control_dependencies([started]):
            update = self._optimizer.apply_gradients(grads_and_vars, global_step=global_step,
                                                     name=name)

        def exchange():
            from . import grouped_allreduce  # (the package's public function)
            from horolite.core.ops import Adasum
            deltas = [v.read_value() - s.read_value() for v, s in zip(variables, starts)]
            reduced = grouped_allreduce(deltas, compression=self._compression, op=Adasum,
                                        name=f"{self.get_name()}.delta")
            done = []
            for v, s, d in zip(variables, starts, reduced):
                new_start = s.assign_add(d, use_locking=self._use_locking)
                done.append(v.assign(new_start, use_locking=self._use_locking))
            with tf.control_dependencies(done):
                return tf.constant(True)

        with tf.control_dependencies([update] if update is not None else []):
            exchanged = tf.cond(communicate, exchange, lambda: tf.constant(False))
        with tf.control_dependencies([exchanged]):
            counted = self._step.assign_add(1)
        return tf.group(counted)

    def get_slot(self, var, name):
        """"delta_start" is this wrapper's; any other slot is the wrapped optimizer's."""
        own = super().get_slot(var, name)
        return own if own is not None else self._optimizer.get_slot(var, name)

    def get_slot_names(self):
        return super().get_slot_names() + self._optimizer.get_slot_names()

    def variables(self, *args, **kwargs):
        return self._optimizer.variables(*args, **kwargs)

