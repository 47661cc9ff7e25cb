"""`hvd.elastic` of `horolite.tensorflow.keras`: KerasState and Horovod's three Keras callbacks.

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    callbacks = [hvd.elastic.CommitStateCallback(state, batches_per_commit=10),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state)]

    @hvd.elastic.run
    def train(state):
        model.fit(..., epochs=epochs - state.epoch, callbacks=callbacks)
"""
from __future__ import annotations

import keras
import tensorflow as tf

from ..elastic import TensorFlowKerasState, run

__all__ = ["KerasState", "CommitStateCallback", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "run"]


class KerasState(TensorFlowKerasState):
    """State of a Keras model and optimizer (`optimizer` default: `model.optimizer`)."""

    def __init__(self, model, optimizer=None, **kwargs):
        super().__init__(model, optimizer=optimizer, backend=tf.keras.backend, **kwargs)


class CommitStateCallback(keras.callbacks.Callback):
    """Commit `state` every `batches_per_commit` batches, and at the end of every epoch."""

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        self.backend = tf.keras.backend
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs=None):
        self.batches_remaining = self.batches_per_commit  # the same count on every rank

    def on_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.commit()

    def commit(self):
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep `state.batch` at the number of the last finished batch (0 after each epoch).

    With `steps_per_epoch`, the first epoch after a reset is shortened by the batches
    already done (in `self.params['steps']`, as in Horovod)."""

    def __init__(self, state):
        super().__init__()
        self.backend = tf.keras.backend
        self.state = state
        self.steps_per_epoch = None

    def on_train_begin(self, logs=None):
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        if self.params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = self.params.get("steps")
            self.params["steps"] = self.steps_per_epoch - self.state.batch

    def on_batch_end(self, batch, logs=None):
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keep `state.epoch` at the number of finished epochs, counted across resets."""

    def __init__(self, state):
        super().__init__()
        self.backend = tf.keras.backend
        self.state = state
        self.initial_epoch = self.state.epoch

    def on_train_begin(self, logs=None):
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch, logs=None):
        # Keras counts this run's epochs from 0; one more, so that a reset after
        # state.batch went back to 0 does not repeat the epoch.
        self.state.epoch = self.initial_epoch + epoch + 1
