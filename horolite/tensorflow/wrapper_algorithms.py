"""The distributed part of the three wrapper optimizers, on allreduce.

Each algorithm has two hooks around the wrapped optimizer's own update:
`before(grads, variables)` returns the gradients to apply (and runs what must
happen first), `after(variables)` runs once the update is applied. They work
eagerly, inside tf.function and in TF1 graphs: in graphs each returns the
ops the next stage must wait for, and periodic work sits in a `tf.cond` on
a step counter that every rank increments alike, so every rank runs the same
collectives in the same order.

State (the step counter, EASGD's center variables) is made by the wrapper
through `make_variable(like, name)` (Keras variables for Keras optimizers, so
they are saved with the optimizer; tf.Variables for the legacy ones).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import tensorflow as tf

import horolite as _core
from horolite.core.ops import ReduceOp

from .functions import variable_ref
from .api import grouped_allreduce
from .bridge import graph_unique_name, run_alone

__all__ = ["ModelAverage", "ElasticAverage", "SyncReplicas"]

# (reference variable or None for the step counter, name) -> a new variable, zeros
MakeVariable = Callable[[Optional[object], str], object]


def _read(v) -> tf.Tensor:
    return tf.identity(tf.convert_to_tensor(v))


def _deps(ops) -> list:
    """What a later stage waits on in a graph (nothing eagerly)."""
    if tf.executing_eagerly() or ops is None:
        return []
    return [op for op in (ops if isinstance(ops, (list, tuple)) else [ops]) if op is not None]


def _when(condition, fn: Callable[[], list]):
    """fn() when `condition` holds: a Python if eagerly, a tf.cond in graphs."""
    if tf.executing_eagerly():
        if bool(condition):
            fn()
        return None

    def run():
        with tf.control_dependencies(_deps(fn())):
            return tf.constant(True)
    return tf.cond(condition, run, lambda: tf.constant(False))


def _collective_name(base: str) -> str:
    """As the collectives name theirs: given eagerly, unique in the graph otherwise."""
    return base if tf.executing_eagerly() else graph_unique_name(base)


class _Periodic:
    """A step counter, and work every `period` applications (after the one that makes
    the count a multiple of it)."""

    def __init__(self, name: str, period: int, what: str):
        if isinstance(period, bool) or int(period) != period or int(period) < 1:
            raise ValueError(f"{name}: {what} must be a positive integer, got {period!r}")
        self.name = name
        self.period = int(period)
        self.step = None

    def build(self, variables: Sequence, make_variable: MakeVariable) -> None:
        if self.step is None:
            self.step = make_variable(None, "horolite_step")

    def _count(self):
        """Increment the counter; the new count."""
        new = self.step.assign_add(1)
        if isinstance(self.step, tf.Variable):
            return new
        return tf.convert_to_tensor(self.step)  # a Keras variable returns the increment

    def after(self, variables: Sequence):
        count = self._count()
        with tf.control_dependencies(_deps(count)):
            return _when(tf.equal(count % self.period, 0), lambda: self.communicate(list(variables)))

    def communicate(self, variables: List) -> list:
        raise NotImplementedError


class ModelAverage(_Periodic):
    """Local SGD: each rank applies its own gradients; every `interval_steps`
    applications the variables are replaced by their average over ranks."""

    def __init__(self, name: str, interval_steps: int):
        super().__init__(name, interval_steps, "interval_steps")

    def before(self, grads, variables):
        return list(grads), []

    def communicate(self, variables):
        means = grouped_allreduce([_read(v) for v in variables], op=ReduceOp.AVERAGE,
                                  name=f"{self.name}.average")
        return [v.assign(m) for v, m in zip(variables, means)]


class ElasticAverage(_Periodic):
    """EASGD on a ring: every rank holds the same center variables. Every
    `communication_period` applications: d = moving_rate * (local - center),
    local -= d, center += sum of d over ranks."""

    def __init__(self, name: str, communication_period: int, moving_rate: Optional[float]):
        super().__init__(name, communication_period, "communication_period")
        if moving_rate is None:
            moving_rate = 0.9 / (self.period * _core.size())  # TensorFlow's default
        if not 0 < float(moving_rate) <= 1:
            raise ValueError(f"{name}: moving_rate must be in (0, 1], got {moving_rate!r}")
        self.moving_rate = float(moving_rate)
        self._centers = {}  # variable ref -> center variable
        self._order = []    # center variables in the order their variables were built

    def build(self, variables, make_variable):
        super().build(variables, make_variable)
        for i, v in enumerate(variables):
            ref = variable_ref(v)
            if ref not in self._centers:
                center = make_variable(v, "center")
                self._centers[ref] = center
                self._order.append(center)

    @property
    def center_variables(self) -> list:
        return list(self._order)

    def center_variable(self, var):
        center = self._centers.get(variable_ref(var))
        if center is None:
            raise ValueError(f"{self.name}: variable {getattr(var, 'name', var)!r} has no center "
                             "variable (the optimizer has not applied gradients to it)")
        return center

    def before(self, grads, variables):
        """On the first application, the centers start from the variables' average over
        ranks (so they are equal everywhere even if the variables were not)."""
        centers = [self.center_variable(v) for v in variables]

        def start():
            means = grouped_allreduce([_read(v) for v in variables], op=ReduceOp.AVERAGE,
                                      name=f"{self.name}.center_init")
            return [c.assign(m) for c, m in zip(centers, means)]
        return list(grads), _deps(_when(tf.equal(tf.convert_to_tensor(self.step), 0), start))

    def communicate(self, variables):
        centers = [self.center_variable(v) for v in variables]
        rate = self.moving_rate
        diffs = [tf.cast(rate, v.dtype) * (_read(v) - _read(c)) for v, c in zip(variables, centers)]
        total = grouped_allreduce(diffs, op=ReduceOp.SUM,
                                  name=f"{self.name}.elastic")
        return ([v.assign_sub(d) for v, d in zip(variables, diffs)] +
                [c.assign_add(s) for c, s in zip(centers, total)])


class SyncReplicas:
    """Each step applies, on every rank, the average of the gradients of the first
    `replicas_to_aggregate` ranks to submit them (a quorum grouped allreduce); the
    others' gradients are dropped for that step, and they apply the same update."""

    def __init__(self, name: str, replicas_to_aggregate: Optional[int],
                 total_num_replicas: Optional[int]):
        size = _core.size()
        if total_num_replicas is not None and int(total_num_replicas) != size:
            raise ValueError(f"{name}: total_num_replicas={total_num_replicas}, but this job has "
                             f"{size} ranks (on allreduce every rank is a replica)")
        k = size if replicas_to_aggregate is None else replicas_to_aggregate
        if isinstance(k, bool) or int(k) != k or not 1 <= int(k) <= size:
            raise ValueError(f"{name}: replicas_to_aggregate must be an integer from 1 to {size} "
                             f"(the number of ranks), got {replicas_to_aggregate!r}")
        self.name = name
        self.replicas_to_aggregate = int(k)
        self.total_num_replicas = size

    def build(self, variables, make_variable):
        pass

    def before(self, grads, variables):
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        dtypes = {g.dtype for g in grads}
        if len(dtypes) > 1:
            raise ValueError(f"{self.name}: gradients of one dtype are aggregated as one "
                             f"decision, got {sorted(d.name for d in dtypes)}")
        if not grads:
            return grads, []
        name = _collective_name(f"{self.name}.aggregate")
        k = self.replicas_to_aggregate

        def submit(*arrays):
            # A GPU job hands over device arrays: the quorum allreduce runs on the host.
            host = [a.get() if hasattr(a, "__cuda_array_interface__") else a for a in arrays]
            return _core.grouped_allreduce_async(host, ReduceOp.AVERAGE, name, quorum=k)
        # The group is packed into one buffer at submit, so the op need not copy first.
        out = run_alone(submit, grads, [g.dtype for g in grads], [g.shape for g in grads],
                        copy=False)
        return list(out), []

    def after(self, variables):
        return None
