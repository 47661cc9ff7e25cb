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
TensorFlow also orders ops after tracing (auto_control_deps): the stateful ops that
take no resource (an enqueue among them) in the order they were made, and the ops
that use one resource in the order they were made (a write after the earlier reads
and writes, a read after the earlier write). An op that such an order will put
before an enqueue, and whatever it needs, therefore never waits for that enqueue.
TensorFlow's CPU rewrite (oneDNN, on by default) also makes one node of a
convolution's filter gradient and the bias gradient taken from the same output
gradient; where the two fall in different buckets, nothing above the one in the later
bucket waits for the earlier bucket's enqueue, or the fused node would need itself.
A collective inside backprop (SyncBatchNormalization's gradient, any horolite
collective with a gradient) was made before every bucket's enqueue, so the buckets
leave once backprop has passed the lowest such collective; a variable that backprop
writes (a custom gradient keeping a record) holds back what its earlier uses need.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Set

from tensorflow.python.framework import auto_control_deps, ops as tf_ops

__all__ = ["BucketOrder", "chained_in_program_order"]

# Filter gradients that oneDNN's graph rewrite fuses with a BiasAddGrad of the same
# output gradient (into one _Mkl...BackpropFilterWithBias node).
_FUSED_WITH_BIAS_GRAD = frozenset({"Conv2DBackpropFilter", "Conv3DBackpropFilterV2"})


def chained_in_program_order(op) -> bool:
    """Whether tf.function orders `op` with every other such op in the order they were
    made (auto_control_deps: TensorFlow's own test of a stateful op, no resource input,
    outside TF1 control flow)."""
    return (auto_control_deps.op_is_stateful(op) and op._get_control_flow_context() is None
            and not _resource_inputs(op))


def _resource_inputs(op) -> List:
    """[(resource tensor id, whether `op` only reads it)], as auto_control_deps sees them."""
    return [(tf_ops.tensor_id(t), kind == auto_control_deps.ResourceType.READ_ONLY)
            for t, kind in auto_control_deps._get_resource_inputs(op)]


class BucketOrder:
    """The enqueues of one step's buckets, in backprop's order, in one graph."""

    def __init__(self, graph):
        self.graph = graph
        self.before: Set = set()  # every op the latest enqueue depends on, and it
        self.latest = None
        # TF1 graphs run what the edges say; a tf.function adds the orders above.
        self.chains = bool(getattr(graph, "building_function", False))
        # What those orders will put before an enqueue that it does not depend on yet,
        # and what that needs: no edge goes there.
        self.later: Set = set()
        # The ops each op will wait for after tracing (by those orders), for the ops made
        # so far; the graph is read once for all buckets, in creation order (per bucket
        # it was O(buckets x ops): +10 s of tracing at 1000 buckets).
        self._orders: Dict = {}
        self._scanned = -1
        self._last_chained = None
        self._last_write: Dict = {}
        self._reads: Dict = {}
        self._partners: List = []  # ops the CPU rewrite may fuse with one in `before`

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
        rest -= self._fused_with_before()  # (they run as they come; what follows them waits)
        added = 0
        for op in rest:
            if op._is_stateful or op._get_control_flow_context() is not None or op in self.later:
                continue  # (TF1 loops and conds take no control input from outside)
            # The first ops of the rest of backprop: none of their inputs is in it.
            if any(t.op in rest for t in op.inputs) or any(c in rest for c in op.control_inputs):
                continue
            op._add_control_input(self.latest)
            added += 1
        return added

    def _fused_with_before(self) -> Set:
        """The ops that the CPU rewrite may fuse with an op some enqueue already needs (a
        filter gradient with its bias gradient), with their ancestors that no enqueue
        needs: a control input on an enqueue there would close a cycle through the fused
        node, in this bucket or any later one."""
        return self._not_before(self._partners)

    def _scan(self, upto: int) -> None:
        """Note what TensorFlow will order each op made before op id `upto` after (as
        auto_control_deps does, in creation order)."""
        by_id = self.graph._nodes_by_id
        for i in range(self._scanned + 1, upto):
            op = by_id[i] if i in by_id else None
            if op is None or op._get_control_flow_context() is not None:
                continue
            after = []
            resources = _resource_inputs(op)
            for key, read_only in dict(resources).items():
                if key in self._last_write:
                    after.append(self._last_write[key])
                if read_only:
                    self._reads.setdefault(key, []).append(op)
                else:
                    after.extend(self._reads.pop(key, []))
                    self._last_write[key] = op
            if not resources and auto_control_deps.op_is_stateful(op):
                if self._last_chained is not None:
                    after.append(self._last_chained)
                self._last_chained = op
            if after:
                self._orders[op] = after
        self._scanned = max(self._scanned, upto - 1)

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
        """Add `ops` and their ancestors to `before`, and (in a tf.function) what
        TensorFlow's orders will put before them, with its ancestors, to `later`."""
        if self.chains:
            self._scan(max(op._id for op in ops) + 1)
        before, later, stack = self.before, self.later, list(ops)
        ordered = []  # ops whose orders are still to follow
        while stack:
            op = stack.pop()
            if op in before or op.graph is not self.graph:
                continue
            before.add(op)
            ordered.append(op)
            partners = (_FUSED_WITH_BIAS_GRAD if op.type == "BiasAddGrad" else
                        ("BiasAddGrad",) if op.type in _FUSED_WITH_BIAS_GRAD else ())
            if partners:
                self._partners.extend(c for t in op.inputs for c in t.consumers()
                                      if c.type in partners)
            stack.extend(t.op for t in op.inputs)
            stack.extend(op.control_inputs)
        stack = [o for op in ordered for o in self._orders.get(op, ())]
        while stack:
            op = stack.pop()
            if op in before or op in later or op.graph is not self.graph:
                continue
            later.add(op)
            stack.extend(t.op for t in op.inputs)
            stack.extend(op.control_inputs)
            stack.extend(self._orders.get(op, ()))
