"""The world's size and ranks as a traced function reads them: when the step runs.

An elastic job without MPI goes on in its running processes after the world changes
(horolite/elastic/in_process.py), and its tf.functions are never traced again. Any
size or rank written into a graph as a constant would then be the old world's (an
average divided by 3 after the job went down to 2 ranks). So a traced function reads
each of them from a small int32 vector variable on the host (the job's four values; three
per process set), which this module sets again each time horolite starts (init, and
every re-formation of an elastic world): one read of each vector per traced graph, no
Python when the step runs, no retrace.

Eagerly (and in TF1 graphs, which have no elastic states) the value is read from the
runtime when the op is made, which is when it runs.
"""
from __future__ import annotations

import threading
import weakref
from typing import Dict, List, Tuple

import tensorflow as tf

import horolite as _core
from horolite.runtime import registry

__all__ = ["live", "read_when_run", "size", "rank", "local_size", "local_rank", "set_size", "set_rank",
           "set_included"]

# One int32 vector per group, so a step captures one variable per group it reads (each
# captured variable costs the call of a tf.function a few microseconds).
_GROUPS = {"size": ("job", 0), "rank": ("job", 1), "local_size": ("job", 2),
           "local_rank": ("job", 3), "set_size": ("set", 0), "set_rank": ("set", 1),
           "set_included": ("set", 2)}
_variables: Dict[Tuple, tf.Variable] = {}  # ("job",) or ("set", id) -> its vector
_lock = threading.Lock()
# graph -> {group: its values as read in that graph}: one read per group and graph
_reads: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _set_ranks(process_set_id: int):
    from horolite.api.process_sets import get_process_set_ids_and_ranks
    return get_process_set_ids_and_ranks().get(int(process_set_id))


def _group_now(group: Tuple) -> List[int]:
    """The group's values from the runtime: the job's [size, rank, local size, local rank],
    a set's [size, this rank's position in it or -1, 1 if this rank is in it else 0]."""
    if group[0] == "job":
        return [_core.size(), _core.rank(), _core.local_size(), _core.local_rank()]
    ranks, me = _set_ranks(group[1]) or [], _core.rank()
    return [len(ranks), ranks.index(me) if me in ranks else -1, int(me in ranks)]


def _traced_in_eager_program() -> bool:
    """Inside a tf.function called from eager code (where state lasts beyond one graph)."""
    return tf.inside_function() and tf.compat.v1.executing_eagerly_outside_functions()


def read_when_run() -> bool:
    """Whether the values made here now are read when their op runs (a tf.function),
    rather than now (eagerly, and in TF1 graphs)."""
    return _traced_in_eager_program()


def live(key: Tuple, name=None) -> tf.Tensor:
    """The value `key` names ((what,) or (what, process set id); what: a key of _GROUPS)
    as an int32 scalar, read when the op runs."""
    kind, index = _GROUPS[key[0]]
    group = (kind,) + tuple(int(k) for k in key[1:])
    if not _traced_in_eager_program():
        return tf.constant(_group_now(group)[index], tf.int32, name=name)
    graph = tf.compat.v1.get_default_graph()
    with _lock:
        var = _variables.get(group)
        if var is None:  # (a set added after init: this trace is then made twice)
            var = _variables[group] = _new(group)
        reads = _reads.setdefault(graph, {})
        values = reads.get(group)
        if values is None:
            # Read once per graph, outside any control dependencies of the place that
            # first asks (a later use elsewhere in the graph must not wait for them).
            with tf.control_dependencies(None), tf.name_scope("horolite_world"):
                values = reads[group] = tf.unstack(var.read_value(), len(_group_now(group)))
    value = values[index]
    return value if name is None else tf.identity(value, name=name)


def size(name=None) -> tf.Tensor:
    return live(("size",), name)


def rank(name=None) -> tf.Tensor:
    return live(("rank",), name)


def local_size(name=None) -> tf.Tensor:
    return live(("local_size",), name)


def local_rank(name=None) -> tf.Tensor:
    return live(("local_rank",), name)


def _set_id(process_set) -> int:
    return 0 if process_set is None else int(getattr(process_set, "process_set_id", 0) or 0)


def set_size(process_set, name=None) -> tf.Tensor:
    """The number of ranks of `process_set` (a ProcessSet, its id, or None: the job)."""
    pid = process_set if isinstance(process_set, int) else _set_id(process_set)
    return size(name) if pid == 0 else live(("set_size", pid), name)


def set_rank(process_set, name=None) -> tf.Tensor:
    """This rank's position in `process_set` (-1 outside it)."""
    pid = process_set if isinstance(process_set, int) else _set_id(process_set)
    return rank(name) if pid == 0 else live(("set_rank", pid), name)


def set_included(process_set_id: int, name=None) -> tf.Tensor:
    return live(("set_included", int(process_set_id)), name)


def _new(group: Tuple) -> tf.Variable:
    with tf.init_scope(), tf.device("/CPU:0"):
        return tf.Variable(_group_now(group), dtype=tf.int32, trainable=False,
                           name="horolite_world_" + "_".join(map(str, group)))


def _groups_now():
    from horolite.api.process_sets import get_process_set_ids_and_ranks
    return [("job",)] + [("set", pid) for pid in get_process_set_ids_and_ranks() if pid]


class _Refresh:
    """Set every variable from the runtime each time horolite starts (the registry calls
    attach(queue) at every init: the new world's values are known then). They are made
    here, before any step is traced: a variable made while tf.function traces makes it
    trace the function a second time."""

    def attach(self, queue) -> None:
        if not tf.compat.v1.executing_eagerly_outside_functions():
            return  # (TF1 graphs read constants: they have no elastic states)
        with _lock, tf.init_scope():
            for group in set(_variables) | set(_groups_now()):
                if group in _variables:
                    _variables[group].assign(_group_now(group))
                else:
                    _variables[group] = _new(group)

    def detach(self, error) -> None:
        pass


registry.add_intake(_Refresh())
