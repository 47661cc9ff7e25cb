"""Backprop waits for each bucket's enqueue, so the bucket leaves while backprop goes on.

A bucket's enqueue op depends only on its own gradients, but TensorFlow's
executor does not run it when those are ready: with few inter-op threads it
follows one chain of backprop (the gradient with respect to the layers' inputs)
to its end and leaves the weight gradients it made ready on the way in its
queue, so every bucket's gradients, and every enqueue, came at the end of the
step (seen on one inter-op thread: all 14 buckets of a 41-layer model taken in
one cycle, 80% into the step).

`order_after` gives the graph the order backprop makes the buckets in: the
ops that the next bucket needs and the enqueues so far do not (the rest of
backprop) get a control input on the latest enqueue. Backprop then makes
bucket k's gradients, enqueues them, and only then goes on to the layers below.
On one thread that is the same work in another order; with many threads it
holds back at most the rest of backprop behind one bucket's last gradient.

Only ops of the graph being built are touched, never a stateful one
(tf.function orders those itself, after tracing, so an edge to one could close
a cycle), and only ops that are not already before the enqueue, so no edge
can make a cycle.
"""
from __future__ import annotations

from typing import Iterable, Set

__all__ = ["BucketOrder"]


class BucketOrder:
    """The enqueues of one step's buckets, in backprop's order, in one graph."""

    def __init__(self, graph):
        self.graph = graph
        self.before: Set = set()  # every op the latest enqueue depends on, and it
        self.latest = None

    def enqueued(self, enqueue_op) -> None:
        """`enqueue_op` (a bucket's) was just made: everything it needs comes before it."""
        self._ancestors([enqueue_op])
        self.latest = enqueue_op

    def order_after(self, tensors: Iterable) -> int:
        """Make what `tensors` (the next bucket's gradients) need, and the latest enqueue
        does not, wait for that enqueue. Returns how many ops got the control input."""
        if self.latest is None:
            return 0
        rest, stack = set(), [t.op for t in tensors if t.graph is self.graph]
        while stack:
            op = stack.pop()
            if op in rest or op in self.before or op.graph is not self.graph:
                continue
            rest.add(op)
            stack.extend(t.op for t in op.inputs)
            stack.extend(op.control_inputs)
        added = 0
        for op in rest:
            if op._is_stateful or op._get_control_flow_context() is not None:
                continue  # (TF1 loops and conds take no control input from outside)
            # The first ops of the rest of backprop: none of their inputs is in it.
            if any(t.op in rest for t in op.inputs) or any(c in rest for c in op.control_inputs):
                continue
            op._add_control_input(self.latest)
            added += 1
        return added

    def _ancestors(self, ops) -> None:
        before, stack = self.before, list(ops)
        while stack:
            op = stack.pop()
            if op in before or op.graph is not self.graph:
                continue
            before.add(op)
            stack.extend(t.op for t in op.inputs)
            stack.extend(op.control_inputs)
