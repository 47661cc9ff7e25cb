"""Keras 3 callbacks with Horovod's names and behaviour."""
from __future__ import annotations

import numpy as np
import tensorflow as tf

import horolite as _core

from ..functions import broadcast_variables, variable_ref
from .model_average import ModelAverageCallback  # local SGD (beyond Horovod)

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "BestModelCheckpoint", "ModelAverageCallback"]

keras = tf.keras


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcast the model's and the optimizer's variables from root_rank when training
    begins, so every rank starts from the same state (again after the first batch if the
    optimizer only built its variables then). `local_variables` (or `register_local_var`)
    are left alone, as in Horovod."""

    def __init__(self, root_rank: int, device: str = "", local_variables=None):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.broadcast_done = False
        self._optimizer_vars = 0
        self._local_refs = set()
        if local_variables is None:
            local_variables = []
        elif variable_ref(local_variables) is not None:
            local_variables = [local_variables]
        for var in local_variables:
            self.register_local_var(var)

    def register_local_var(self, var):
        """`var` is this worker's own: it is not broadcast."""
        ref = variable_ref(var)
        if ref is None:
            raise ValueError(f"All local variables must be variables, not {type(var).__name__}")
        self._local_refs.add(ref)

    def _broadcast(self):
        variables = [v for v in self.model.variables if variable_ref(v) not in self._local_refs]
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


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Horovod's: a ModelCheckpoint that keeps only the best model (save_best_only=True).
    Keras 3 needs a file to save to: `filepath` (horolite's extra keyword, last) defaults
    to "best_model.keras" ("best_model.weights.h5" with save_weights_only)."""

    def __init__(self, monitor="val_loss", verbose=0, save_weights_only=False, mode="auto",
                 save_freq="epoch", filepath=None):
        if filepath is None:
            filepath = "best_model.weights.h5" if save_weights_only else "best_model.keras"
        super().__init__(filepath=filepath, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)


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
    < end_epoch (end_epoch None: no end), set before the first batch of each epoch
    (staircase) or before every batch, the epoch then fractional (epoch + batch /
    steps_per_epoch, taken from fit when not given). A constant `multiplier` is an
    exponential decay, `multiplier ** (epoch - start_epoch)`, as in Horovod; a callable is
    a function of the epoch. The rate is logged as `lr` at each epoch's end.

    momentum_correction (Horovod's, on optimizers with a `momentum`): when the rate changes
    from old to new, the step taken with the new rate uses momentum * new / old. Keras 3
    compiles the momentum coefficient into the train step, so horolite scales the
    optimizer's momentum buffers by new / old instead, which gives the same update for
    SGD and RMSprop (each multiplies its buffer by the momentum once per step)."""

    def __init__(self, initial_lr, multiplier, start_epoch: int = 0, end_epoch=None,
                 staircase: bool = True, momentum_correction: bool = True, steps_per_epoch=None):
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr = initial_lr
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = None
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            self.multiplier = lambda epoch: multiplier ** (epoch - start_epoch)

    def _autodetect_steps_per_epoch(self):
        params = self.params or {}
        if params.get("steps"):
            return params["steps"]
        if params.get("samples") and params.get("batch_size"):
            return params["samples"] // params["batch_size"]
        raise ValueError("Could not autodetect the number of steps per epoch. Please specify the "
                         f"steps_per_epoch parameter to the {type(self).__name__}().")

    def _adjust_learning_rate(self, epoch):
        opt = self.model.optimizer
        old_lr = float(opt.learning_rate.numpy())
        new_lr = self.initial_lr * self.multiplier(epoch)
        opt.learning_rate.assign(new_lr)
        if self.momentum_correction and getattr(opt, "momentum", 0) and old_lr > 0 and new_lr != old_lr:
            _scale_momentum_buffers(opt, new_lr / old_lr)

    def on_train_begin(self, logs=None):
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        epoch = self.current_epoch
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if self.staircase and batch == 0:
            self._adjust_learning_rate(epoch)
        elif not self.staircase:
            self._adjust_learning_rate(epoch + float(batch) / self.steps_per_epoch)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = float(self.model.optimizer.learning_rate.numpy())


def _scale_momentum_buffers(opt, factor: float) -> None:
    """Multiply the optimizer's momentum buffers by factor (see LearningRateScheduleCallback)."""
    buffers = getattr(opt, "momentums", None) or getattr(opt, "_momentums", None) or []
    if not buffers and opt.built:
        raise NotImplementedError(
            f"momentum_correction: {type(opt).__name__} has a momentum but no momentum buffers "
            "horolite knows (SGD's `momentums`, RMSprop's `_momentums`); pass momentum_correction=False")
    for buf in buffers:
        buf.assign(buf * tf.cast(factor, buf.dtype))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Horovod's warmup: over `warmup_epochs`, the learning rate grows from about
    initial_lr / size to initial_lr, set before every batch: lr = initial_lr / size *
    (e * (size - 1) / warmup_epochs + 1) with e = epoch + (batch + 1) / steps_per_epoch,
    so the last batch of the warmup uses initial_lr itself.

    `initial_lr` is the target rate, usually already scaled by size().
    """

    def __init__(self, initial_lr, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch=None, verbose: int = 0):
        def multiplier(epoch):
            epoch += 1.0 / self.steps_per_epoch
            n = _core.size()
            return 1.0 / n * (epoch * (n - 1) / warmup_epochs + 1)
        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and _core.rank() == 0:
            new_lr = float(self.model.optimizer.learning_rate.numpy())
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {new_lr:g}.")
