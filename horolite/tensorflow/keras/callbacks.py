"""Keras 3 callbacks with Horovod's names and behaviour."""
from __future__ import annotations

import numpy as np
import tensorflow as tf

import horolite as _core

from ..functions import broadcast_variables
from .model_average import ModelAverageCallback  # local SGD (beyond Horovod)

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "ModelAverageCallback"]

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


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Horovod's schedule: lr = initial_lr * multiplier(epoch) while start_epoch <= epoch
    < end_epoch (end_epoch None: no end), set when each epoch begins (staircase) or
    before every batch, the epoch then fractional (epoch + batch / steps_per_epoch,
    steps_per_epoch taken from fit when not given). `multiplier` is a number or a
    function of the epoch. The rate is logged as `lr` at each epoch's end.
    `momentum_correction` is accepted for compatibility; Keras 3 optimizers keep
    no momentum scaled by the rate, so it has no effect."""

    def __init__(self, initial_lr, multiplier, start_epoch: int = 0, end_epoch=None,
                 staircase: bool = True, momentum_correction: bool = True, steps_per_epoch=None,
                 verbose: int = 0, initial_epoch: int = 0):
        super().__init__()
        self.initial_lr = float(initial_lr)
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self.current_epoch = initial_epoch

    def _active(self, epoch) -> bool:
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def lr_at(self, epoch: float) -> float:
        return self.initial_lr * float(self.multiplier(epoch))

    def on_train_begin(self, logs=None):
        if self.steps_per_epoch is None:
            self.steps_per_epoch = self.params.get("steps") if self.params else None

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch
        if self.staircase and self._active(epoch):
            self.model.optimizer.learning_rate.assign(self.lr_at(epoch))

    def on_train_batch_begin(self, batch, logs=None):
        if self.staircase or not self._active(self.current_epoch):
            return
        steps = self.steps_per_epoch or 1
        self.model.optimizer.learning_rate.assign(self.lr_at(self.current_epoch + float(batch) / steps))

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = float(self.model.optimizer.learning_rate.numpy())


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Horovod's warmup: over `warmup_epochs`, the learning rate grows from
    initial_lr / size to initial_lr, adjusted every batch
    (lr = initial_lr / size * (epoch * (size - 1) / warmup_epochs + 1), epoch fractional),
    and is initial_lr from then on.

    `initial_lr` is the target rate, usually already scaled by size().
    """

    def __init__(self, initial_lr, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch=None, verbose: int = 0, initial_epoch: int = 0):
        def multiplier(epoch):
            n = _core.size()
            return 1.0 / n * (epoch * (n - 1) / warmup_epochs + 1)
        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch, verbose=verbose,
                         initial_epoch=initial_epoch)
        self.warmup_epochs = warmup_epochs

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.warmup_epochs - 1:
            self.model.optimizer.learning_rate.assign(self.initial_lr)
            if self.verbose and _core.rank() == 0:
                print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {self.initial_lr:g}.")
        super().on_epoch_end(epoch, logs)
