"""The world's size and ranks as a traced function reads them: when the step runs.

An elastic job without MPI goes on in its running processes after the world changes
(horolite/elastic/in_process.py), and its tf.functions are never traced again. Any
size or rank written into a graph as a constant would then be the old world's (an
average divided by 3 after the job went down to 2 ranks). So a traced function reads
each of them from a small int32 variable on the host, which this module sets again
each time horolite starts (init, and every re-formation of an elastic world): one
ReadVariableOp per value, no Python when the step runs, no retrace.

Eagerly (and in TF1 graphs, which have no elastic states) the value is read from the
runtime when the op is made, which is when it runs.
"""
from __future__ import annotations

import threading
from typing import Callable, Dict, Tuple

import tensorflow as tf

import horolite as _core
from horolite.runtime import registry

__all__ = ["live", "read_when_run", "size", "rank", "local_size", "local_rank", "set_size", "set_rank",
           "set_included"]

_variables: Dict[Tuple, tf.Variable] = {}
_lock = threading.Lock()


def _set_ranks(process_set_id: int):
    from horolite.api.process_sets import get_process_set_ids_and_ranks
    return get_process_set_ids_and_ranks().get(int(process_set_id))


def _member_rank(process_set_id: int) -> int:
    ranks = _set_ranks(process_set_id) or []
    me = _core.rank()
    return ranks.index(me) if me in ranks else -1


_READERS: Dict[str, Callable[..., int]] = {
    "size": lambda: _core.size(),
    "rank": lambda: _core.rank(),
    "local_size": lambda: _core.local_size(),
    "local_rank": lambda: _core.local_rank(),
    "set_size": lambda pid: len(_set_ranks(pid) or []),
    "set_rank": _member_rank,
    "set_included": lambda pid: int(_core.rank() in (_set_ranks(pid) or [])),
}


def _now(key: Tuple) -> int:
    return int(_READERS[key[0]](*key[1:]))


def _traced_in_eager_program() -> bool:
    """Inside a tf.function called from eager code (where state lasts beyond one graph)."""
    return tf.inside_function() and tf.compat.v1.executing_eagerly_outside_functions()


def read_when_run() -> bool:
    """Whether the values made here now are read when their op runs (a tf.function),
    rather than now (eagerly, and in TF1 graphs)."""
    return _traced_in_eager_program()


def live(key: Tuple, name=None) -> tf.Tensor:
    """The value `key` names (see _READERS) as an int32 scalar, read when the op runs."""
    if not _traced_in_eager_program():
        return tf.constant(_now(key), tf.int32, name=name)
    with _lock:
        var = _variables.get(key)
        if var is None:  # (a set added after init: this trace is then made twice)
            var = _variables[key] = _new(key)
    value = var.read_value()
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


def _new(key: Tuple) -> tf.Variable:
    with tf.init_scope(), tf.device("/CPU:0"):
        return tf.Variable(_now(key), dtype=tf.int32, trainable=False,
                           name="horolite_" + "_".join(map(str, key)))


def _keys_now():
    from horolite.api.process_sets import get_process_set_ids_and_ranks
    keys = [("size",), ("rank",), ("local_size",), ("local_rank",)]
    for pid in get_process_set_ids_and_ranks():
        keys += [("set_size", pid), ("set_rank", pid), ("set_included", pid)]
    return keys


class _Refresh:
    """Set every variable from the runtime each time horolite starts (the registry calls
    attach(queue) at every init: the new world's values are known then). They are made
    here, before any step is traced: a variable made while tf.function traces makes it
    trace the function a second time."""

    def attach(self, queue) -> None:
        if not tf.compat.v1.executing_eagerly_outside_functions():
            return  # (TF1 graphs read constants: they have no elastic states)
        with _lock, tf.init_scope():
            for key in set(_variables) | set(_keys_now()):
                if key in _variables:
                    _variables[key].assign(_now(key))
                else:
                    _variables[key] = _new(key)

    def detach(self, error) -> None:
        pass


registry.add_intake(_Refresh())
