"""`hvd.elastic` for TensorFlow 2: Horovod 0.28.1's names over horolite's elastic restarts.

    @hvd.elastic.run
    def train(state): ...          # state.commit() every few batches
    state = hvd.elastic.TensorFlowKerasState(model, optimizer, batch=0)
    train(state)                   # run with: horolite-run --min-np 2 ... python train.py

A lost rank or a changed host set restarts the job; each rank resumes from the newest
commit (see horolite/elastic and docs/elastic.md). Eager execution only.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

import horolite as _core
from horolite.api.basics import rank
from horolite.elastic import (HorovodInternalError, HostsUpdatedInterrupt, ObjectState, State,
                              run_fn)

from .aggregation import start_every_group_again
from .functions import broadcast_object, broadcast_variables

__all__ = ["TensorFlowKerasState", "TensorFlowState", "run", "State", "ObjectState",
           "HorovodInternalError", "HostsUpdatedInterrupt"]


def run(func):
    """Decorator for the elastic training function `func(state, *args, **kwargs)`.

    Before `func` runs, the state is synchronized (after a restart: first restored from
    the newest commit); a change of hosts or a lost rank restarts the job from the last
    commit. Collectives must not be called in the decorated call itself."""
    return run_fn(func, None)


def _eager(what: str) -> None:
    if not tf.executing_eagerly():
        raise ValueError(f"{what}: horolite's elastic states need eager execution "
                         "(TensorFlow 2 without tf.compat.v1.disable_eager_execution())")


def _value(var):
    return var.value if hasattr(var, "path") else var  # Keras 3 variable or tf.Variable


def _optimizer_variables(optimizer) -> list:
    if optimizer is None:
        return []
    found = optimizer.variables
    return list(found() if callable(found) else found)  # Keras 2's method, Keras 3's property


def _host_array(tensor) -> np.ndarray:
    """The tensor's values as a NumPy array, without a copy where TensorFlow allows it
    (a saved tensor is never changed, so a read-only view of it is safe to write out)."""
    view = getattr(tensor, "_numpy", None)
    return view() if view is not None else tensor.numpy()


def _build_optimizer(optimizer, variables) -> None:
    """Make an optimizer's slots now if it has none yet: a process that just joined holds
    an optimizer that never stepped, and Keras 3 (at `build`, the first `apply` or `fit`'s
    start) and TensorFlow's v1 optimizers (at their first `apply_gradients`) make their
    variables only then; the survivors already hold them, and sync broadcasts them all."""
    if optimizer is None or not variables:
        return
    if hasattr(optimizer, "built") and hasattr(optimizer, "build"):  # Keras 3
        if not optimizer.built:
            import keras
            with keras.name_scope(optimizer.name, caller=optimizer):
                optimizer.build(list(variables))
            optimizer.built = True
    elif isinstance(optimizer, tf.compat.v1.train.Optimizer):
        with tf.init_scope():
            optimizer._create_slots([_value(v) for v in variables])


def _agree_on_counts(counts: dict, name: str) -> None:
    """Before the first broadcast of a sync: every rank holds as many variables of each
    kind as rank 0, else a ValueError on every rank naming the counts and the ranks (a
    broadcast of lists of different lengths would wait for ever on the longer one's tail)."""
    kinds = list(counts)
    mine = np.array([[counts[k] for k in kinds]], dtype=np.int64)
    every = np.asarray(_core.allgather(mine, name=f"{name}.counts"))
    problems = []
    for j, kind in enumerate(kinds):
        by_count = {}
        for r, c in enumerate(every[:, j].tolist()):
            by_count.setdefault(int(c), []).append(r)
        if len(by_count) > 1:
            problems.append(f"{kind} " + " but ".join(
                f"{c} on rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"
                for c, rs in sorted(by_count.items(), key=lambda item: item[1][0])))
    if problems:
        raise ValueError(f"{name}: the ranks hold different numbers of variables to sync: "
                         + "; ".join(problems) + " (every rank must build the same model "
                         "and optimizer before the state syncs)")


def _model_built(model) -> bool:
    return model.built if hasattr(model, "build") else True


def _assign_all(variables, values, what: str) -> None:
    variables, values = list(variables), list(values)
    if len(variables) != len(values):
        raise ValueError(f"{what}: the committed state has {len(values)} variables, this "
                         f"process has {len(variables)}")
    for var, value in zip(variables, values):
        var.assign(value)


class _TensorSnapshots(ObjectState):
    """A state whose tensors are copied aside at each save and assigned back at restore
    (subclasses say which tensors, in _save_model and _load_model)."""

    def save(self):
        self._save_model()
        super().save()

    def restore(self):
        self._load_model()
        super().restore()


class TensorFlowKerasState(_TensorSnapshots):
    """State of a Keras model and its optimizer, plus any keyword properties.

    Args:
        model: a built Keras model.
        optimizer: optional; default `model.optimizer`.
        backend: accepted for Horovod's TensorFlow 1 sessions; unused (eager only).
        kwargs: additional properties to sync, exposed as attributes.
    """

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        _eager("TensorFlowKerasState")
        self.model = model
        if not _model_built(model):
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        self.optimizer = optimizer or model.optimizer
        self.backend = backend
        self._save_model()
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)

    def sync(self):
        start_every_group_again()  # (backward_passes_per_step: see aggregation.py)
        _build_optimizer(self.optimizer, self.model.trainable_variables)
        optimizer_vars = _optimizer_variables(self.optimizer)
        if _core.size() > 1:
            _agree_on_counts({"model": len(self.model.variables),
                              "optimizer": len(optimizer_vars)}, "horolite.elastic.sync")
        broadcast_variables(self.model.variables, root_rank=0,
                            name="horolite.elastic.sync.model")
        if optimizer_vars:
            broadcast_variables(optimizer_vars, root_rank=0,
                                name="horolite.elastic.sync.optimizer")
        self._save_model()
        super().sync()

    def _save_model(self):
        self._saved_model_state = [tf.identity(_value(v)) for v in self.model.variables]
        self._saved_optimizer_state = [tf.identity(_value(v))
                                       for v in _optimizer_variables(self.optimizer)]

    def _load_model(self):
        _assign_all(self.model.variables, self._saved_model_state, "model")
        _assign_all(_optimizer_variables(self.optimizer), self._saved_optimizer_state,
                    "optimizer")

    def _durable_state(self):
        return dict(super()._durable_state(),
                    model=[_host_array(t) for t in self._saved_model_state],
                    optimizer=[_host_array(t) for t in self._saved_optimizer_state])

    def _load_durable(self, obj):
        saved_optimizer = obj["optimizer"]
        if saved_optimizer:  # (a new process's optimizer has no variables yet)
            _build_optimizer(self.optimizer, self.model.trainable_variables)
        self._saved_model_state = [tf.convert_to_tensor(a) for a in obj["model"]]
        self._saved_optimizer_state = [tf.convert_to_tensor(a) for a in saved_optimizer]
        self._load_model()
        super()._load_durable(obj)


class TensorFlowState(_TensorSnapshots):
    """State of a list of TensorFlow variables, plus any keyword properties.

    Args:
        variables: the `tf.Variable`s to track (default `tf.compat.v1.global_variables()`).
        session: accepted for Horovod's TensorFlow 1 sessions; eager execution only here.
        kwargs: additional properties to sync, exposed as attributes.
    """

    def __init__(self, variables=None, session=None, **kwargs):
        _eager("TensorFlowState")
        self.variables = variables or tf.compat.v1.global_variables()
        self.session = session
        self._save_model()
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)

    def sync(self):
        start_every_group_again()
        if _core.size() > 1:
            _agree_on_counts({"TensorFlowState": len(self.variables)},
                             "horolite.elastic.sync")
        if self.variables:
            broadcast_variables(self.variables, root_rank=0, name="horolite.elastic.sync.vars")
        self._save_model()
        super().sync()

    def _save_model(self):
        self._values = [np.array(_value(v).numpy(), copy=True) for v in self.variables]

    def _load_model(self):
        _assign_all(self.variables, self._values, "TensorFlowState")

    def _durable_state(self):
        return dict(super()._durable_state(), variables=self._values)

    def _load_durable(self, obj):
        self._values = list(obj["variables"])
        self._load_model()
        super()._load_durable(obj)
