"""Keras 3 callbacks with Horovod's names and behaviour."""
from __future__ import annotations

import numpy as np
import tensorflow as tf

import horolite as _core

from ..functions import broadcast_variables

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateWarmupCallback"]

keras = tf.keras


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcast the model's and the optimizer's variables from root_rank when training
    begins, so every rank starts from the same state (again after the first batch if the
    optimizer only built its variables then)."""

    def __init__(self, root_rank: int, device: str = ""):
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False
        self._optimizer_vars = 0

    def _broadcast(self):
        variables = list(self.model.variables)
        opt = getattr(self.model, "optimizer", None)
        opt_vars = list(opt.variables) if opt is not None and getattr(opt, "built", False) else []
        broadcast_variables(variables + opt_vars, self.root_rank, name="BroadcastGlobalVariablesCallback")
        self._optimizer_vars = len(opt_vars)

    def on_train_begin(self, logs=None):
        if not self.broadcast_done:
            self._broadcast()
            self.broadcast_done = True

    def on_train_batch_end(self, batch, logs=None):
        opt = getattr(self.model, "optimizer", None)
        if batch == 0 and opt is not None and len(opt.variables) != self._optimizer_vars:
            self._broadcast()


class MetricAverageCallback(keras.callbacks.Callback):
    """At the end of every epoch, replace each logged metric by its average over ranks
    (put it before callbacks that read the logs, such as checkpoints or early stopping)."""

    def __init__(self, device: str = ""):
        super().__init__()

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
        values = np.array([float(logs[k]) for k in keys], np.float64)
        averaged = _core.allreduce(values, op=_core.Average, name=f"MetricAverageCallback.{epoch}")
        for k, v in zip(keys, averaged):
            logs[k] = float(v)


class LearningRateWarmupCallback(keras.callbacks.Callback):
    """Horovod's warmup: over `warmup_epochs`, the learning rate grows from
    initial_lr / size to initial_lr, adjusted every batch
    (lr = initial_lr / size * (epoch * (size - 1) / warmup_epochs + 1), epoch fractional).

    `initial_lr` is the target rate, usually already scaled by size().
    `momentum_correction` is accepted for compatibility; Keras 3 optimizers
    keep no momentum scaled by the rate, so it has no effect.
    """

    def __init__(self, initial_lr, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch=None, verbose: int = 0, initial_epoch: int = 0):
        super().__init__()
        self.initial_lr = float(initial_lr)
        self.warmup_epochs = warmup_epochs
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self.current_epoch = initial_epoch

    def on_train_begin(self, logs=None):
        if self.steps_per_epoch is None:
            self.steps_per_epoch = self.params.get("steps") if self.params else None

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def lr_at(self, epoch: float) -> float:
        n = _core.size()
        if epoch >= self.warmup_epochs:
            return self.initial_lr
        return self.initial_lr / n * (epoch * (n - 1) / self.warmup_epochs + 1)

    def on_train_batch_begin(self, batch, logs=None):
        if self.current_epoch >= self.warmup_epochs:
            return
        steps = self.steps_per_epoch or 1
        lr = self.lr_at(self.current_epoch + float(batch) / steps)
        self.model.optimizer.learning_rate.assign(lr)

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.warmup_epochs - 1:
            self.model.optimizer.learning_rate.assign(self.initial_lr)
            if self.verbose and _core.rank() == 0:
                print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {self.initial_lr:g}.")
        if logs is not None:
            logs["lr"] = float(self.model.optimizer.learning_rate.numpy())
