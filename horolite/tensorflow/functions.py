"""Broadcasting variables and Python objects, gathering objects."""
from __future__ import annotations

import pickle
from typing import Any, List, Optional

import numpy as np
import tensorflow as tf

import horolite as _core
from horolite.api import objects as _objects
from horolite.errors import HorovodInternalError

from .bridge import graph_unique_name, to_tf_error, wait, _enqueue
from .process_sets import check_process_set, global_process_set

__all__ = ["broadcast_variables", "broadcast_", "broadcast_object", "broadcast_object_fn",
           "allgather_object", "broadcast_global_variables", "variable_name"]


def variable_name(var, index: int) -> str:
    """A name for a variable's collective: its index (unique) and its path or name (readable)."""
    label = getattr(var, "path", None) or getattr(var, "name", None) or "var"
    return f"{index}.{label.replace(':', '_')}"


def variable_ref(var):
    """A hashable identity for a tf.Variable or a Keras 3 variable, else None.

    Keras 3 variables are not tf.Variables: they have no .ref() and are not
    hashable, but each wraps one tf.Variable, whose reference serves."""
    if isinstance(var, tf.Variable):
        return var.ref()
    if hasattr(var, "path"):  # Keras 3
        inner = getattr(var, "value", None)
        if isinstance(inner, tf.Variable):
            return inner.ref()
    return None


def broadcast_variables(variables, root_rank: int, process_set=global_process_set,
                        inplace: bool = False, name: Optional[str] = None):
    """Assign root_rank's value to every variable on every rank (Horovod's signature;
    `inplace` is accepted: the variables are assigned either way; `name` is horolite's).

    Eagerly this runs at once and returns None; in a graph it returns the op.
    All broadcasts are enqueued before any is awaited, so they fuse.
    """
    if tf.executing_eagerly() or _core.is_initialized():
        # In a graph, as in Horovod, building the op needs no init(): running it does
        # (the enqueue then raises NotInitializedError naming the variable).
        check_process_set(process_set, "broadcast_variables")
    variables = list(variables)
    prefix = name or "broadcast_variables"
    if not tf.executing_eagerly():
        prefix = graph_unique_name(prefix)
    root_rank = int(root_rank)
    hids, values = [], []
    for i, var in enumerate(variables):
        vname = f"{prefix}.{variable_name(var, i)}"
        value = tf.convert_to_tensor(var.value if hasattr(var, "path") else var)  # Keras 3 or tf.Variable
        values.append(value)
        hids.append(_enqueue(lambda a, n=vname: _core.broadcast_async(a, root_rank, n, process_set),
                             [value]))
    assigns = []
    deps = None if tf.executing_eagerly() else hids
    with tf.control_dependencies(deps):
        for var, hid, value in zip(variables, hids, values):
            assigns.append(var.assign(wait(hid, [value.dtype], [value.shape])[0]))
    if tf.executing_eagerly():
        return None
    return tf.group(*assigns)


def broadcast_(variables, root_rank: int, name: Optional[str] = None, process_set=global_process_set):
    """Horovod's in-place broadcast: assign root_rank's values to `variables` (one
    variable or a list); returns their values as broadcast."""
    check_process_set(process_set, "broadcast_")
    single = not isinstance(variables, (list, tuple))
    variables = [variables] if single else list(variables)
    op = broadcast_variables(variables, root_rank, process_set, name=name or "broadcast_")
    with tf.control_dependencies(None if op is None else [op]):
        values = [tf.convert_to_tensor(v.value if hasattr(v, "path") else v.read_value()) for v in variables]
    return values[0] if single else values


def broadcast_global_variables(root_rank: int):
    """TF1: an op that broadcasts every global variable from root_rank."""
    if tf.executing_eagerly():
        raise RuntimeError("broadcast_global_variables() needs a TF1 graph; eagerly, use "
                           "broadcast_variables(model.variables, root_rank)")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank,
                               name="broadcast_global_variables")


def _sync(fn):
    try:
        return fn()
    except HorovodInternalError as e:
        raise to_tf_error(e) from e


def broadcast_object(obj: Any, root_rank: int = 0, session=None, name: Optional[str] = None,
                     process_set=global_process_set) -> Any:
    """Pickle `obj` on root_rank and return a copy on every rank. It travels in Python,
    outside any graph, so TF1 code needs no `session` (accepted, as Horovod's keyword)."""
    check_process_set(process_set, "broadcast_object")
    return _sync(lambda: _objects.broadcast_object(obj, root_rank, name, process_set))


def broadcast_object_fn(root_rank: int = 0, session=None, name: Optional[str] = None,
                        process_set=global_process_set):
    """Horovod's factory for TF1 code: a function obj -> root_rank's obj. (horolite
    broadcasts objects in Python, so no session is needed; `session` is accepted.)"""
    check_process_set(process_set, "broadcast_object_fn")
    return lambda obj: broadcast_object(obj, root_rank, name=name, process_set=process_set)


def allgather_object(obj: Any, session=None, name: Optional[str] = None,
                     process_set=global_process_set) -> List[Any]:
    """Every rank's `obj`, as a list indexed by rank (set rank on a process set;
    `session` accepted, not needed)."""
    check_process_set(process_set, "allgather_object")
    name = name or "allgather_object"
    payload = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    lengths = _sync(lambda: _core.allgather(np.array([payload.size], np.int64), name=f"{name}.length",
                                            process_set=process_set))
    data = _sync(lambda: _core.allgather(payload, name=f"{name}.data", process_set=process_set))
    out, start = [], 0
    for n in lengths.tolist():
        out.append(pickle.loads(data[start:start + n].tobytes()))
        start += n
    return out
