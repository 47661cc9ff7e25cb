"""Model averaging as a Keras callback: local SGD with any optimizer in `model.fit`.

The same algorithm as ModelAverageOptimizer, where a callback reads better
(the optimizer stays the one compiled in): every rank trains on its own
batches with no exchange, and after every `interval_steps`-th batch the
model's trainable variables are replaced by their average over ranks.
"""
from __future__ import annotations

import tensorflow as tf

from ..api import grouped_allreduce
from horolite.core.ops import ReduceOp

__all__ = ["ModelAverageCallback"]


class ModelAverageCallback(tf.keras.callbacks.Callback):
    """Average the model's trainable variables over ranks every `interval_steps`
    batches (counted across epochs); at the end of training too if
    `average_at_end` (so every rank ends with the same model)."""

    def __init__(self, interval_steps: int = 100, average_at_end: bool = False):
        super().__init__()
        if isinstance(interval_steps, bool) or int(interval_steps) != interval_steps or interval_steps < 1:
            raise ValueError(f"ModelAverageCallback: interval_steps must be a positive integer, "
                             f"got {interval_steps!r}")
        self.interval_steps = int(interval_steps)
        self.average_at_end = bool(average_at_end)
        self.steps = 0

    def _average(self):
        variables = list(self.model.trainable_variables)
        if not variables:
            return
        means = grouped_allreduce([tf.convert_to_tensor(v) for v in variables], op=ReduceOp.AVERAGE,
                                  name="ModelAverageCallback")
        for v, m in zip(variables, means):
            v.assign(m)

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if self.steps % self.interval_steps == 0:
            self._average()

    def on_train_end(self, logs=None):
        if self.average_at_end and self.steps % self.interval_steps:
            self._average()
