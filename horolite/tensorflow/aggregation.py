"""Local gradient aggregation: `backward_passes_per_step` batches summed on this rank,
reduced once, on the last of them (Horovod's semantics)."""
from __future__ import annotations

import weakref

import tensorflow as tf

from .functions import variable_name
from .gradients import GradientReducer, after_all

__all__ = ["LocalAggregator", "start_every_group_again"]

_every = weakref.WeakSet()  # this process's aggregators (start_every_group_again)


def start_every_group_again() -> None:
    """Drop the passes summed since each aggregator's group began (eagerly): an elastic
    state's sync calls it, so that every rank of a new world, a worker that just joined
    too, begins a group at the same pass (else their exchanges no longer line up)."""
    for agg in list(_every):
        if agg.counter is not None:
            for a in agg.accumulators:
                if a is not None:
                    a.assign(tf.zeros_like(a))
            agg.counter.assign(0)


class LocalAggregator:
    """Sum gradients locally for `passes` calls; reduce the sum on the last one.

    State (a call counter and one accumulator per variable) lives in
    non-trainable variables created on the first call. On the calls that do
    not communicate, the returned gradients are zeros (dense, of each
    variable's shape; None stays None); `apply` runs the update only when the
    counter is back at 0, i.e. right after a communicating call.
    """

    def __init__(self, passes: int, average: bool, reducer: GradientReducer):
        self.passes = int(passes)
        self.average = bool(average)
        self.reducer = reducer
        self.counter = None
        self.accumulators = None
        _every.add(self)

    def _build(self, grads, variables):
        with tf.init_scope():
            self.counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="horolite_agg_counter")
            self.accumulators = [
                None if g is None else tf.Variable(tf.zeros(v.shape, g.dtype), trainable=False,
                                                   name="horolite_agg_" + variable_name(v, i).replace("/", "_").replace(".", "_"))
                for i, (g, v) in enumerate(zip(grads, variables))]

    def __call__(self, grads, variables):
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        if self.accumulators is None:
            self._build(grads, variables)
        elif len(self.accumulators) != len(grads):
            raise ValueError(f"backward_passes_per_step: got {len(grads)} gradients, but the "
                             f"aggregation state was built for {len(self.accumulators)}")
        pairs = [(a, g) for a, g in zip(self.accumulators, grads) if g is not None]
        dropped = self._drop_a_failed_group()
        # Every sum waits for every gradient of the pass: a pass whose backprop fails part
        # way on this rank adds nothing (else the gradients made before the error stayed in
        # the sums, and the next exchange reduced them with the passes that worked).
        with tf.control_dependencies(after_all([g for _, g in pairs] + [dropped])
                                     if not tf.executing_eagerly() else None):
            updates = [a.assign_add(g) for a, g in pairs]
        with tf.control_dependencies(updates if not tf.executing_eagerly() else None):
            count = self.counter.assign_add(1)
        ready = tf.equal(count, self.passes)

        def communicate():
            total = [None if a is None else a.read_value() for a in self.accumulators]
            reduced = self.reducer(total, variables)
            if self.average:
                reduced = [r if r is None else r / tf.cast(self.passes, r.dtype) for r in reduced]
            deps = [r for r in reduced if r is not None] if not tf.executing_eagerly() else None
            with tf.control_dependencies(after_all(deps) if deps else None):
                resets = [a.assign(tf.zeros_like(a)) for a in self.accumulators if a is not None]
                resets.append(self.counter.assign(0))
            with tf.control_dependencies(after_all(resets) if not tf.executing_eagerly() else None):
                return [tf.zeros_like(a) if r is None and a is not None else
                        (None if r is None else tf.identity(r))
                        for r, a in zip(reduced, self.accumulators)]

        def skip():
            return [None if a is None else tf.zeros_like(a) for a in self.accumulators]

        if tf.executing_eagerly():
            return communicate() if bool(ready) else skip()
        present = [i for i, a in enumerate(self.accumulators) if a is not None]

        def pick(fn):
            def branch():
                values = fn()
                return [values[i] for i in present]
            return branch
        chosen = tf.cond(ready, pick(communicate), pick(skip))
        if not isinstance(chosen, (list, tuple)):
            chosen = [chosen]
        out = [None] * len(self.accumulators)
        for i, t in zip(present, chosen):
            out[i] = t
        return out

    def _drop_a_failed_group(self):
        """A counter already at `passes` when a pass begins: the exchange that ended the
        last group failed (its error reached the caller, on every rank) and left its sums.
        They are dropped and this pass begins a new group; else the counter went past
        `passes` and no later call ever exchanged or applied again."""
        def reset():
            ops = [a.assign(tf.zeros_like(a)) for a in self.accumulators if a is not None]
            ops.append(self.counter.assign(0))
            return ops
        if tf.executing_eagerly():
            if int(self.counter.numpy()) >= self.passes:
                reset()
            return None

        def reset_in_graph():
            with tf.control_dependencies(reset()):
                return tf.constant(True)
        return tf.cond(tf.greater_equal(self.counter, self.passes), reset_in_graph,
                       lambda: tf.constant(False))

    def should_apply(self):
        """True (a bool tensor in graphs) right after a communicating call."""
        return tf.equal(self.counter, 0)
