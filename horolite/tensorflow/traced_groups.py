"""Per-tensor allreduces traced in one tf.function go to the runtime together.

Horovod's classic loop, `[hvd.allreduce(g) for g in grads]` inside a tf.function,
makes one enqueue op per tensor. TensorFlow runs them one after another, so the
background thread sees them trickle in, and cycle by cycle the ranks agree on
whatever prefix each has: the step goes out in several batches. Here the ops
traced one after another in one function graph form a group: the background
thread holds each member until every member of the group has been enqueued, then
submits them all at once, in trace order, so every rank has all of them in one
cycle and they fuse as one grouped call would.

A member may only be held for the others if nothing the others need waits for it.
An op joins the open group only when its input does not depend on a member's
result, and when no stateful op was traced since the last member: tf.function runs
stateful ops (the enqueue ops among them) in program order, and such an op may
itself wait for a member's result. TF1 graphs and eager calls have no groups (a
TF1 session may run only some of a graph's ops). A step that fails before every
member was enqueued cancels the members' wait ops (async_wait.cc); the members
held for it are dropped when the group's next run starts.
"""
from __future__ import annotations

import threading
from typing import Callable, List, Optional, Tuple

import tensorflow as tf

__all__ = ["Group", "Member", "join", "joined"]


class Group:
    """One group of a traced function; `size` is final once the function is traced."""

    def __init__(self, first_id: int):
        self.first_id = first_id  # the first member's enqueue op: members' results come later
        self.last_id = first_id   # the latest member's enqueue op
        self.size = 0
        self.enqueues = set()     # the members' enqueue ops
        self._lock = threading.Lock()
        self._held: dict = {}     # index -> (hid, submit, arrays) of the run being collected

    def collect(self, index: int, held: Tuple) -> Tuple[Optional[List[Tuple]], List[Tuple]]:
        """(every member's (hid, submit, arrays) in trace order once all have come, else None;
        the members of an abandoned run, to be dropped)."""
        with self._lock:
            stale = []
            if index in self._held:  # a new run began before the last one was complete
                stale, self._held = list(self._held.values()), {}
            self._held[index] = held
            if len(self._held) < self.size:
                return None, stale
            ready, self._held = [self._held[i] for i in range(self.size)], {}
            return ready, stale


class Member:
    __slots__ = ("group", "index", "submit")

    def __init__(self, group: Group, index: int, submit: Callable):
        self.group, self.index, self.submit = group, index, submit


def join(tensors, submit: Callable) -> Optional[Member]:
    """The open group of the function being traced, for an allreduce of `tensors` about
    to be enqueued (a new group when it must not wait for the open one); None outside
    a tf.function. Call `joined` with the enqueue op once it is made."""
    graph = tf.compat.v1.get_default_graph()
    if not getattr(graph, "building_function", False):
        return None
    group = getattr(graph, "_horolite_group", None)
    if group is not None and not _may_wait_for(group, graph, tensors):
        group = None
    if group is None:
        group = Group(first_id=0)  # (set by joined to the first member's enqueue op)
        graph._horolite_group = group
    member = Member(group, group.size, submit)
    group.size += 1
    return member


def joined(member: Member, enqueue_op) -> None:
    group = member.group
    group.enqueues.add(enqueue_op)
    group.last_id = enqueue_op._id
    if member.index == 0:
        group.first_id = enqueue_op._id


def _may_wait_for(group: Group, graph, tensors) -> bool:
    """Whether an allreduce of tensors may be held until the open group's members come."""
    nodes, op_id = graph._nodes_by_id, group.last_id + 1
    while True:  # the ops traced since the last member (a graph's op ids are consecutive)
        try:
            op = nodes[op_id]
        except KeyError:
            break
        if op.type != "HorolitEnqueue" and _ordered_with_enqueues(op):
            return False
        op_id += 1
    # Does an input depend on a member's enqueue (so on its result)? Only ops made since
    # the group's first member can.
    seen, stack = set(), [t.op for t in tensors]
    while stack:
        op = stack.pop()
        if op._id < group.first_id or op in seen:
            continue
        if op in group.enqueues:
            return False
        seen.add(op)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    return True


def _ordered_with_enqueues(op) -> bool:
    """A stateful op that tf.function chains in program order with the enqueue ops (one
    without resource inputs: auto_control_deps orders those one after another)."""
    if not op._is_stateful:
        return False
    return not any(t.dtype == tf.resource for t in op.inputs)
