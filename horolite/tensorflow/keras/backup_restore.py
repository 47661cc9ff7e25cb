"""Keras 3's `BackupAndRestore` made right for a job: rank 0 writes, every rank restores.

Unpatched, every rank of a job writes the same backup files (racing on a shared file
system) and, after a restart, each rank restores whatever its own disk holds. Installed
when `horolite.tensorflow.keras` is imported, and acting only when horolite runs with
more than one rank:

- only rank 0 writes the backup (and deletes it at the end of training);
- at the start of `fit`, rank 0 restores as Keras does; then its weights, its
  optimizer's variables and the epoch to start from are broadcast to every rank, so
  all resume at the same epoch with the same state (other ranks need no copy of the
  files); an error restoring on rank 0 is raised on every rank.
"""
from __future__ import annotations

import tensorflow as tf

import horolite as _core

from ..functions import broadcast_object, broadcast_variables

__all__ = ["install"]

_installed = False


def _in_job() -> bool:
    return _core.is_initialized() and _core.size() > 1


def _optimizer_variables(model) -> list:
    opt = getattr(model, "optimizer", None)
    return list(opt.variables) if opt is not None and getattr(opt, "built", False) else []


def install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    cls = tf.keras.callbacks.BackupAndRestore
    original_begin, original_save, original_end = cls.on_train_begin, cls._save_model, \
        cls.on_train_end

    def on_train_begin(self, logs=None):
        if not _in_job():
            return original_begin(self, logs)
        restored, epoch, error = False, None, None
        if _core.rank() == 0:
            try:
                restored = tf.io.gfile.exists(self._weights_path) or \
                    tf.io.gfile.exists(self._prev_weights_path)
                original_begin(self, logs)
                epoch = getattr(self.model, "_initial_epoch", None)
            except Exception as e:  # said on every rank, not only here
                error = f"{type(e).__name__}: {e}"
        restored, epoch, error = broadcast_object((restored, epoch, error), 0,
                                                  name="BackupAndRestore.on_train_begin")
        if error is not None:
            raise RuntimeError(f"BackupAndRestore: rank 0 could not restore the backup in "
                               f"{self.backup_dir}: {error}")
        if not restored:
            return
        opt = getattr(self.model, "optimizer", None)
        if opt is not None and not opt.built:
            opt.build(self.model.trainable_variables)
        broadcast_variables(list(self.model.variables) + _optimizer_variables(self.model), 0,
                            name="BackupAndRestore.restored")
        self.model._initial_epoch = epoch

    def _save_model(self):
        if not _in_job() or _core.rank() == 0:
            original_save(self)

    def on_train_end(self, logs=None):
        if not _in_job() or _core.rank() == 0:
            original_end(self, logs)

    on_train_begin.__doc__ = original_begin.__doc__
    cls.on_train_begin, cls._save_model, cls.on_train_end = on_train_begin, _save_model, \
        on_train_end
