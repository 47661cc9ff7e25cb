"""The classic distributed wrapper optimizers of TensorFlow 1, on allreduce.

    opt = hvd.ModelAverageOptimizer(tf.keras.optimizers.SGD(0.1), interval_steps=100)
    opt = hvd.ElasticAverageOptimizer(tf.compat.v1.train.AdamOptimizer(1e-3), communication_period=10)
    opt = hvd.SyncReplicasOptimizer(tf.keras.optimizers.SGD(0.1), replicas_to_aggregate=3)

Each wraps a Keras 3 optimizer (returning an instance of a subclass of its
class, so it works in `model.fit`) or a `tf.compat.v1.train.Optimizer` (a
legacy optimizer whose `compute_gradients` is the wrapped one's), as
DistributedOptimizer does. Gradients passed to them are this rank's own: do
not wrap the tape or the optimizer in DistributedGradientTape/DistributedOptimizer
too. What each does is in wrapper_algorithms.py.
"""
from __future__ import annotations

from typing import Optional

import tensorflow as tf

from .legacy_slots import ForwardSlots
from .wrapper_algorithms import ElasticAverage, ModelAverage, SyncReplicas, _deps

__all__ = ["ModelAverageOptimizer", "ElasticAverageOptimizer", "SyncReplicasOptimizer"]


def ModelAverageOptimizer(optimizer, interval_steps: int = 100, name: Optional[str] = None,
                          use_locking: bool = False):
    """Model averaging (local SGD): `apply_gradients` applies this rank's gradients
    locally, with no exchange; after the application that makes the step count a
    multiple of `interval_steps`, every variable it updated is replaced by its
    average over ranks (one grouped allreduce)."""
    name = name or f"ModelAverage{type(optimizer).__name__}"
    return _wrap(optimizer, ModelAverage(name, interval_steps), name, use_locking)


def ElasticAverageOptimizer(optimizer, communication_period: int = 10,
                            moving_rate: Optional[float] = None, name: Optional[str] = None,
                            use_locking: bool = False):
    """Elastic averaging SGD. Each rank keeps center variables, equal on every rank,
    which start from the variables' average over ranks at the first application.
    After the application that makes the step count a multiple of
    `communication_period`: d = moving_rate * (local - center), local -= d,
    center += sum of d over ranks (one grouped allreduce). moving_rate=None:
    0.9 / (communication_period * size()), TensorFlow's default. The centers are
    `optimizer.center_variables` and `optimizer.center_variable(var)`."""
    name = name or f"ElasticAverage{type(optimizer).__name__}"
    return _wrap(optimizer, ElasticAverage(name, communication_period, moving_rate), name,
                 use_locking)


def SyncReplicasOptimizer(optimizer, replicas_to_aggregate: Optional[int] = None,
                          total_num_replicas: Optional[int] = None, name: Optional[str] = None,
                          use_locking: bool = False):
    """Synchronous replicas with backup workers: each step applies, on every rank, the
    average of the gradients of the first `replicas_to_aggregate` ranks (default:
    all) to submit them; later ranks' gradients are dropped for that step, and they
    apply the same update, so the variables stay identical everywhere.
    total_num_replicas, if given, must be size()."""
    name = name or f"SyncReplicas{type(optimizer).__name__}"
    return _wrap(optimizer, SyncReplicas(name, replicas_to_aggregate, total_num_replicas), name,
                 use_locking)


def _wrap(optimizer, algorithm, name: str, use_locking: bool):
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        return _LegacyWrapper(optimizer, algorithm, name, use_locking)
    if isinstance(optimizer, tf.keras.optimizers.Optimizer):
        new = _keras_class(type(optimizer)).from_config(optimizer.get_config())
        new._horolite_algorithm = algorithm
        return new
    raise TypeError(f"{name}: expected a Keras optimizer or a tf.compat.v1.train.Optimizer, "
                    f"got {type(optimizer).__name__}")


def _applied(grads, variables):
    """The (gradient, variable) pairs with a gradient: the variables an application updates."""
    pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
    return [g for g, _ in pairs], [v for _, v in pairs]


class _CentersMixin:
    """EASGD's center variables, on both kinds of wrapper."""

    @property
    def center_variables(self) -> list:
        return self._horolite_algorithm.center_variables

    def center_variable(self, var):
        return self._horolite_algorithm.center_variable(var)


# ----------------------------------------------------------------- Keras ----

class _KerasWrapperMixin(_CentersMixin):
    """Mixed into the wrapped Keras optimizer's class."""

    def build(self, variables):
        super().build(variables)
        self._horolite_algorithm.build(list(variables), self._horolite_variable)

    def _horolite_variable(self, like, name):
        if like is None:
            return self.add_variable((), initializer="zeros", dtype="int64", name=name)
        return self.add_variable_from_reference(like, name=name)

    def apply(self, grads, trainable_variables=None):
        variables = (list(trainable_variables) if trainable_variables is not None
                     else list(self._trainable_variables))
        if not self.built:
            with tf.name_scope(self.name):
                self.build(variables)
            self.built = True
        grads, variables = _applied(list(grads), variables)
        if not variables:
            return None
        algorithm = self._horolite_algorithm
        grads, ready = algorithm.before(grads, variables)
        with tf.control_dependencies(ready):
            super().apply(grads, variables)
        algorithm.after(variables)
        return None


_keras_classes = {}


def _keras_class(base: type) -> type:
    """One subclass per optimizer class, carrying the base's module and name (as
    DistributedOptimizer's does), so a saved model names the class it wrapped."""
    cls = _keras_classes.get(base)
    if cls is None:
        cls = _keras_classes[base] = type(base.__name__, (_KerasWrapperMixin, base),
                                          {"__module__": base.__module__,
                                           "__qualname__": base.__qualname__})
    return cls


# ---------------------------------------------------------------- legacy ----

class _LegacyWrapper(_CentersMixin, ForwardSlots, tf.compat.v1.train.Optimizer):
    """Wraps a tf.compat.v1.train.Optimizer; eager, tf.function and TF1 graphs."""

    def __init__(self, optimizer, algorithm, name: str, use_locking: bool = False):
        super().__init__(name=name, use_locking=use_locking)
        self._optimizer = optimizer
        self._horolite_algorithm = algorithm

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's (gradient, variable) pairs, this rank's own."""
        return self._optimizer.compute_gradients(*args, **kwargs)

    def _horolite_variable(self, like, name):
        with tf.init_scope():
            if like is None:
                return tf.Variable(tf.constant(0, tf.int64), trainable=False,
                                   name=f"{self._name}_{name}")
            label = str(getattr(like, "name", "var")).split(":")[0].replace("/", "_")
            return tf.Variable(tf.zeros(like.shape, like.dtype.base_dtype), trainable=False,
                               name=f"{self._name}_{label}_{name}")

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        grads_and_vars = list(grads_and_vars)
        grads, variables = _applied(*zip(*grads_and_vars)) if grads_and_vars else ([], [])
        if not variables:
            return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step, name=name)
        algorithm = self._horolite_algorithm
        algorithm.build(variables, self._horolite_variable)
        grads, ready = algorithm.before(grads, variables)
        with tf.control_dependencies(ready):
            apply_op = self._optimizer.apply_gradients(list(zip(grads, variables)),
                                                       global_step=global_step, name=name)
        with tf.control_dependencies(_deps(apply_op)):
            done = algorithm.after(variables)
        if tf.executing_eagerly():
            return apply_op
        return tf.group(apply_op, *_deps(done))
