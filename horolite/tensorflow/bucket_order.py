"""Backprop waits for each bucket's enqueue, so the bucket leaves while backprop goes on.

A bucket's enqueue op depends only on its own gradients, but TensorFlow's
executor does not run it when those are ready: with few inter-op threads it
follows one chain of backprop (the gradient with respect to the layers' inputs)
to its end and leaves the weight gradients it made ready on the way in its
queue, so every bucket's gradients, and every enqueue, came at the end of the
step (measured on one inter-op thread: 12 buckets of a 13-layer model enqueued
within 0.5 ms of each other at the end of backprop, against spread over its
7 ms with this ordering; docs/tensorflow.md).

`order_after` gives the graph the order backprop makes the buckets in: the
ops that the next bucket needs and the enqueues so far do not (the rest of
backprop) get a control input on the latest enqueue. Backprop then makes
bucket k's gradients, enqueues them, and only then goes on to the layers below.
On one thread that is the same work in another order; with many threads it
holds back at most the rest of backprop behind one bucket's last gradient.

No edge may close a cycle. Only ops of the graph being built are touched, never
a stateful one, and only ops not already before the enqueue. In a tf.function,
TensorFlow also chains the stateful ops that take no resource (an enqueue among
them) in the order they were made, after tracing: a collective inside backprop
(SyncBatchNormalization's gradient, any horolite collective with a gradient) was
made before every bucket's enqueue, so the enqueue comes after it. An op that
such a collective needs therefore never waits for an enqueue: the buckets then
leave once backprop has passed the lowest such collective.
"""
from __future__ import annotations

from typing import Iterable, List, Set

import tensorflow as tf

__all__ = ["BucketOrder", "chained_in_program_order"]


def chained_in_program_order(op) -> bool:
    """Whether tf.function orders `op` with every other such op in the order they were
    made (auto_control_deps: stateful, no resource input, outside TF1 control flow)."""
    return (op._is_stateful and op._get_control_flow_context() is None
            and not any(t.dtype == tf.resource for t in op.inputs))


class BucketOrder:
    """The enqueues of one step's buckets, in backprop's order, in one graph."""

    def __init__(self, graph):
        self.graph = graph
        self.before: Set = set()  # every op the latest enqueue depends on, and it
        self.latest = None
        # TF1 graphs run what the edges say; a tf.function adds the chain above.
        self.chains = bool(getattr(graph, "building_function", False))
        # The chained ops seen so far, in creation order, and the last op id scanned: the
        # graph is read once for all buckets, not once per bucket (that was
        # O(buckets x ops): +10 s of tracing at 1000 buckets).
        self._chained: List = []
        self._scanned = -1

    def enqueued(self, enqueue_op) -> None:
        """`enqueue_op` (a bucket's) was just made: everything it needs comes before it."""
        self._ancestors([enqueue_op])
        self.latest = enqueue_op

    def order_after(self, tensors: Iterable) -> int:
        """Make what `tensors` (the next bucket's gradients) need, and the latest enqueue
        does not, wait for that enqueue. Returns how many ops got the control input."""
        if self.latest is None:
            return 0
        rest = self._not_before([t.op for t in tensors if t.graph is self.graph])
        # Ops that a chained op made before the enqueue needs: an edge there is a cycle.
        feeds_chain = self._not_before(self._chained_before(self.latest)) if self.chains else set()
        added = 0
        for op in rest:
            if op._is_stateful or op._get_control_flow_context() is not None or op in feeds_chain:
                continue  # (TF1 loops and conds take no control input from outside)
            # The first ops of the rest of backprop: none of their inputs is in it.
            if any(t.op in rest for t in op.inputs) or any(c in rest for c in op.control_inputs):
                continue
            op._add_control_input(self.latest)
            added += 1
        return added

    def _chained_before(self, enqueue) -> List:
        """The chained ops made before `enqueue` that it does not already depend on."""
        if enqueue._id > self._scanned + 1:
            by_id = self.graph._nodes_by_id
            for i in range(self._scanned + 1, enqueue._id):
                if i in by_id and chained_in_program_order(by_id[i]):
                    self._chained.append(by_id[i])
            self._scanned = enqueue._id - 1
        return [op for op in self._chained if op._id < enqueue._id and op not in self.before]

    def _not_before(self, ops) -> Set:
        """`ops` and their ancestors that the latest enqueue does not need."""
        found, stack = set(), list(ops)
        while stack:
            op = stack.pop()
            if op in found or op in self.before or op.graph is not self.graph:
                continue
            found.add(op)
            stack.extend(t.op for t in op.inputs)
            stack.extend(op.control_inputs)
        return found

    def _ancestors(self, ops) -> None:
        before, stack = self.before, list(ops)
        while stack:
            op = stack.pop()
            if op in before or op.graph is not self.graph:
                continue
            before.add(op)
            stack.extend(t.op for t in op.inputs)
            stack.extend(op.control_inputs)
