"""The bridge between TensorFlow and the runtime: an enqueue op and a wait op.

Every collective is split into an *enqueue* op, which hands the NumPy array to
the runtime (`horolite.*_async`) and returns at once with an int64 handle id,
and a *wait* op, which returns the result once the handle is done. The enqueue
op is a `tf.numpy_function` marked stateful, so it runs eagerly, inside
`tf.function` and in TF1 graphs alike, with pip alone. In graphs the wait op is
the small native asynchronous op of `native_ops` when it could be built (it
holds no TensorFlow thread while it waits, and raises TensorFlow's error class
for the runtime's error); otherwise a blocking `tf.numpy_function`.

Splitting matters inside graphs: a caller that reduces many tensors (the
gradient tape, the optimizers) makes every wait op depend on *all* enqueue ops
of the step. Enqueues never block, so no TensorFlow thread can sit in a wait
while a tensor that another rank is waiting for still needs a thread to be
enqueued: no cross-rank deadlock whatever order TensorFlow schedules in.

On a GPU job (NCCL up on every rank, and TensorFlow sees a GPU) the two ops are
`tf.py_function`s instead, so GPU tensors reach the runtime through DLPack and
travel over NCCL without a host copy; host tensors in the same job still go
through NumPy. Which tensor goes which way, and which ops a graph gets, is
decided in gpu_route.py.

Names: an explicit name is used as given in eager mode; in graphs it is made
unique within the graph (`graph.unique_name`), and a missing name is derived
from the input tensor's name there, so ranks that build the same graph agree
(a tf.cond branch or loop body is named after its place in the outer graph,
never after TensorFlow's process-wide counter: see `_graph_scope`).
In eager mode a missing name falls back to the runtime's per-kind counters
(ranks must then call in the same order, as in Horovod).
"""

import itertools
import re
import threading
from typing import Callable, List, Optional, Sequence

import numpy as np
import tensorflow as tf

import horolite as _core
from horolite.api.collectives import _grouped_allreduce_async, submit_and_wait
from horolite.errors import HorovodInternalError, NotInitializedError
from horolite.core.ops import Average, ReduceOp

from . import gpu_route, native_ops, traced_groups
from .eager import eager_tensor
from .intake import intake_for, submit_to_wait_op

__all__ = ["enqueue_allreduce", "enqueue_grouped_allreduce", "grouped_allreduce_submit", "wait",
           "run_alone", "to_tf_error", "graph_unique_name", "across_traces"]

def _leave_to_python() -> None:
    """Keep AutoGraph out of horolite's own code, as TensorFlow keeps it out of Keras and
    NumPy. Called inside a tf.function, AutoGraph would otherwise convert every function
    horolite calls while tracing (warning about those it cannot, os.makedirs among them),
    and the submit functions the background thread later runs for each collective would
    run as converted code: milliseconds of AutoGraph's bookkeeping per call."""
    try:
        from tensorflow.python.autograph.core import config
    except ImportError:  # (a TensorFlow without this module: it converts, and warns)
        return
    if not any(getattr(rule, "_prefix", None) == "horolite" for rule in config.CONVERSION_RULES):
        config.CONVERSION_RULES = (config.DoNotConvert("horolite"),) + tuple(config.CONVERSION_RULES)


_leave_to_python()

# handle id -> horolite.Handle, between an enqueue op and its wait op.
_handles = {}
_handles_lock = threading.Lock()
_ids = itertools.count(1)


def _store(handle) -> np.int64:
    hid = next(_ids)
    with _handles_lock:
        _handles[hid] = handle
    return np.int64(hid)


def _take(hid):
    with _handles_lock:
        return _handles.pop(int(hid))


def to_tf_error(exc: BaseException) -> Exception:
    """The TensorFlow error Horovod raises for a runtime error, with the message (naming
    the tensor): FailedPreconditionError for ranks that disagree (and duplicate names),
    InvalidArgumentError for bad arguments, AbortedError for a shutdown or stall.

    Eagerly the ops raise it themselves; in graphs the native wait op raises the same
    class. Without the native op, a Python op's error class is TensorFlow's choice
    (ValueError -> InvalidArgumentError, anything else -> UnknownError).
    """
    cls = _ERROR_CLASSES.get(native_ops.error_code(exc), tf.errors.UnknownError)
    return cls(None, None, f"{type(exc).__name__}: {exc}")


_ERROR_CLASSES = {3: tf.errors.InvalidArgumentError, 9: tf.errors.FailedPreconditionError,
                  10: tf.errors.AbortedError, 2: tf.errors.UnknownError}


def _guarded(fn: Callable) -> Callable:
    """fn for an eager call, raising TensorFlow's error classes (see to_tf_error)."""
    def run(*args):
        try:
            return fn(*args)
        except (HorovodInternalError, NotInitializedError) as e:
            raise to_tf_error(e) from e
    return run


# ---------------------------------------------------------------- naming ----

def _normalize(name: str) -> str:
    return name.replace(":", "_").replace("/", "_")


def graph_unique_name(base: str) -> str:
    """A name unique in the current graph, the same on every rank that builds the same graph."""
    graph = tf.compat.v1.get_default_graph()
    name = graph.unique_name(base, mark_as_used=True)
    scope = _graph_scope(graph)
    return f"{scope}/{name}" if scope else name


def across_traces(name: str) -> str:
    """`name` (graph_unique_name's, in the current graph) as every trace makes it: the
    numbers telling nested graphs apart dropped. A tf.function called in another is traced
    anew in each outer trace, twice in the first where that made variables, and numbered
    there: fit's step sends `one_step_on_data_1/...` in its first trace, then
    `one_step_on_data/...`. A failed step is found across traces by this name
    (BucketRuns). Graphs it merges (two conds) run one after the other in tf.function."""
    scope = _graph_scope(tf.compat.v1.get_default_graph())
    if not scope or not name.startswith(scope + "/"):
        return name
    return "/".join(_UID_SUFFIX.sub("", part) for part in scope.split("/")) + name[len(scope):]


_UID_SUFFIX = re.compile(r"_\d+$")


def _graph_scope(graph) -> str:
    """A function graph's path of names, the same on every rank.

    A tf.cond branch or tf.while_loop body is a graph named with TensorFlow's
    process-wide op counter (`cond_true_1234`), which differs between ranks that
    built different graphs before (one that traced an extra function, a test
    that branched on the rank): a collective named after it would wait forever
    for a name no other rank submits. So a graph nested in another is named by
    its outer graph instead (its name without the counter, made unique there),
    and the outermost function graph by its own name (the traced function's)."""
    if not hasattr(graph, "outer_graph"):
        return ""  # a TF1 graph
    scope = getattr(graph, "_horolite_scope", None)
    if scope is None:
        outer = graph.outer_graph
        if outer is not None and hasattr(outer, "outer_graph"):
            local = outer.unique_name(_UID_SUFFIX.sub("", graph.name) or "graph", mark_as_used=True)
            scope = f"{_graph_scope(outer)}/{local}"
        else:
            scope = graph.name
        graph._horolite_scope = scope
    return scope


def _resolve_name(name: Optional[str], prefix: str, tensor) -> Optional[str]:
    if tf.executing_eagerly():
        return name  # None: the runtime's deterministic counters
    if name is None:
        tname = getattr(tensor, "name", None) or "tensor"
        name = f"{prefix}_{_normalize(tname)}"
    return graph_unique_name(name)


# ---------------------------------------------------- the enqueue/wait ops ----

def _enqueue(submit: Callable, tensors: Sequence[tf.Tensor], copy: bool = True,
             groupable: bool = False):
    """Run `submit(*arrays) -> Handle` as an op; returns the int64 handle id (a Python int eagerly).

    copy=False only for a submit that copies what it keeps itself (a grouped
    allreduce packs its members, see collectives._grouped_allreduce_async).
    groupable: a per-tensor allreduce, which goes to the runtime with the others traced
    beside it in a tf.function (traced_groups.py)."""
    # Copy: the runtime keeps the array after this op returns, and must never
    # hold (or be the last to release) memory that TensorFlow owns.
    if not tf.executing_eagerly():
        _refuse_xla()
    if _device_ops([t.dtype for t in tensors]):
        # GPU job: tf.py_function hands over the tensors where they live, and GPU
        # tensors go to the runtime through DLPack, so they travel over NCCL.
        def fn(*ts):
            return _store(submit(*[_to_runtime(t) for t in ts]))
        if tf.executing_eagerly():
            return _guarded(fn)(*tensors)
        hid = tf.py_function(fn, list(tensors), tf.int64, name="HorolitEnqueue")
    elif tf.executing_eagerly():
        def fn(*arrays):
            return _store(submit(*([np.array(a, copy=True) for a in arrays] if copy else arrays)))
        # np.asarray: a view of the tensor's memory (t.numpy() would copy it first); the
        # submit copies what it keeps (above, or by packing a group) before returning.
        return _guarded(fn)(*[np.asarray(t) for t in tensors])
    else:
        native = native_ops.load()
        if native is not None and all(_native_dtype(t.dtype) for t in tensors):
            # No Python on TensorFlow's thread, no copy: the op keeps the tensors until
            # the collective is done, and the background thread reads them (intake.py).
            member = traced_groups.join(tensors, submit) if groupable else None
            hid = native.enqueue(tensors, intake_for(native).register(member or submit))
            if member is not None:
                traced_groups.joined(member, hid.op)
        else:
            def fn(*arrays):
                arrays = [np.array(a, copy=True) for a in arrays] if copy else arrays
                if native is None:
                    return _store(submit(*arrays))
                hid = next(_ids)  # the native wait op waits for it (intake.submit_to_wait_op)
                submit_to_wait_op(native, hid, submit, arrays)
                return np.int64(hid)
            hid = tf.numpy_function(fn, list(tensors), tf.int64, stateful=True,
                                    name="HorolitEnqueue")
    hid.set_shape([])
    return hid


def _native_dtype(dtype: tf.DType) -> bool:
    """What the native enqueue op hands over: fixed-size elements (strings go through the
    Python op, and are refused there as before)."""
    return dtype != tf.string and dtype.is_numpy_compatible


def _nccl_active() -> bool:
    """True when the runtime moves device arrays over NCCL (every rank has a GPU)."""
    try:
        return _core.api.basics.runtime().nccl is not None
    except NotInitializedError:
        return False


def _device_ops(dtypes: Sequence[tf.DType]) -> bool:
    """Eagerly: NCCL is up (each tensor is then routed by where its memory is). In a
    graph: gpu_route.device_ops, so ops that can only see host memory keep the host
    ops (the native wait op included)."""
    if not _nccl_active():
        return False  # (the host path: nothing more to ask)
    if tf.executing_eagerly():
        return True
    return gpu_route.device_ops(True, _tf_gpu_count(), [d.name for d in dtypes])


_tf_gpus: List[int] = []


def _tf_gpu_count() -> int:
    """How many GPUs TensorFlow has (fixed once its runtime is up; 0 for a CPU build)."""
    if not _tf_gpus:
        _tf_gpus.append(len(tf.config.list_logical_devices("GPU")))
    return _tf_gpus[0]


def _refuse_xla() -> None:
    """horolite's ops hand tensors to a runtime outside TensorFlow, which XLA cannot compile: say so instead of XLA's
    generic "unsupported operations" (Keras turns XLA on by itself on GPU machines)."""
    from tensorflow.python.ops import control_flow_util
    if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        raise ValueError("horolite's collectives cannot run inside an XLA-compiled function "
                         "(jit_compile=True): compile the model or tf.function with "
                         "jit_compile=False")


def _to_runtime(t: tf.Tensor):
    """A tensor in GPU memory as a CuPy copy on its own GPU (gpu_route.route decides, from
    where the memory is: inside a py_function t.device says CPU); else a NumPy copy."""
    if gpu_route.tensor_route(t, True)[0] == gpu_route.CUDA:
        return gpu_route.to_device_array(t)
    return np.array(t.numpy(), copy=True)


def _from_runtime(result, dtype: tf.DType) -> tf.Tensor:
    if hasattr(result, "__cuda_array_interface__"):
        from horolite.core.tf_dlpack import cupy_to_tf
        return tf.cast(cupy_to_tf(result), dtype)
    return tf.convert_to_tensor(np.asarray(result).astype(dtype.as_numpy_dtype, copy=False))


def wait(hid, dtypes: Sequence[tf.DType], shapes: Sequence, with_rows: bool = False) -> List[tf.Tensor]:
    """The wait op: synchronize handle `hid`; returns one tensor per dtype.

    with_rows (allgathers): then also, per result, every rank's first dimension
    (int64, in rank order), which the gradient needs to find this rank's rows.
    """
    np_dtypes = [d.as_numpy_dtype for d in dtypes]
    if with_rows:
        shapes = list(shapes) + [[None]] * len(dtypes)  # (a process set's size, or the job's)
        all_dtypes = list(dtypes) + [tf.int64] * len(dtypes)
    else:
        all_dtypes = list(dtypes)

    def results(h):
        handle = _take(h)
        result = handle.result()
        if not isinstance(result, (list, tuple)):
            result, dims = [result], [handle.first_dims]
        else:
            dims = handle.first_dims
        return result, ([np.asarray(d, np.int64) for d in dims] if with_rows else [])

    def fetch(h):
        result, rows = results(h)
        return [np.asarray(r).astype(d, copy=False) for r, d in zip(result, np_dtypes)] + rows

    if _device_ops(dtypes):
        def fetch_tensors(h):
            result, rows = results(int(h))
            return [_from_runtime(r, d) for r, d in zip(result, dtypes)] + \
                [tf.constant(r) for r in rows]

        if tf.executing_eagerly():
            return _guarded(fetch_tensors)(hid)
        outs = tf.py_function(fetch_tensors, [hid], all_dtypes, name="HorolitWait")
        for out, shape in zip(outs, shapes):
            out.set_shape(shape)
        return list(outs)
    if tf.executing_eagerly():
        return [eager_tensor(r) for r in _guarded(fetch)(hid)]
    native = native_ops.load()
    if native is not None:
        outs = native.op(hid, all_dtypes)
    else:
        outs = tf.numpy_function(fetch, [hid], all_dtypes, stateful=True, name="HorolitWait")
    for out, shape in zip(outs, shapes):
        out.set_shape(shape)
    return list(outs)


def _run(submit: Callable, tensors: Sequence[tf.Tensor], dtypes, shapes,
         groupable: bool = False) -> List[tf.Tensor]:
    if tf.executing_eagerly() and not _nccl_active():
        # Submit and wait in one call: the tensors outlive it, so the runtime reads them
        # where they lie (no copy), and the result becomes a tensor on its own memory.
        result = _guarded(lambda *arrays: submit_and_wait(submit, *arrays))(
            *[np.asarray(t) for t in tensors])
        results = result if isinstance(result, (list, tuple)) else [result]
        return [eager_tensor(np.asarray(r).astype(d.as_numpy_dtype, copy=False))
                for r, d in zip(results, dtypes)]
    return wait(_enqueue(submit, tensors, groupable=groupable), dtypes, shapes)


def run_alone(submit: Callable, tensors: Sequence[tf.Tensor], dtypes, shapes,
              copy: bool = True) -> List[tf.Tensor]:
    """Submit and wait in one op, for a collective that is the only one its graph
    waits on (a gradient reducer's single request of a step), so no other enqueue
    can be held up behind its wait. One Python op instead of two saved 0.3 ms a
    step on this VM after a compute-heavy step. GPU jobs, eager calls and the native
    ops keep the enqueue/wait pair. (TensorFlow converts what fn returns to `dtypes` itself.)"""
    if tf.executing_eagerly() or _device_ops(dtypes) or native_ops.load() is not None:
        return wait(_enqueue(submit, tensors, copy), dtypes, shapes)
    _refuse_xla()

    def fn(*arrays):
        if copy:
            arrays = [np.array(a, copy=True) for a in arrays]
        return submit_and_wait(submit, *arrays)

    outs = tf.numpy_function(fn, list(tensors), list(dtypes), stateful=True, name="HorolitCollective")
    for out, shape in zip(outs, shapes):
        out.set_shape(shape)
    return outs


def enqueue_allreduce(tensor: tf.Tensor, name: Optional[str], op=Average,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set=None):
    """Enqueue op only (pair it with `wait(hid, [tensor.dtype], [tensor.shape])`)."""
    op, pre, post = ReduceOp(op), float(prescale_factor), float(postscale_factor)
    return _enqueue(lambda a: _core.allreduce_async(a, op, name, pre, post,
                                                    process_set=process_set), [tensor])


def enqueue_grouped_allreduce(tensors: Sequence[tf.Tensor], name: Optional[str], op=Average,
                              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                              process_set=None):
    """One enqueue op for a group: it runs once every tensor exists, and they fuse together."""
    submit, copy = grouped_allreduce_submit(name, op, prescale_factor, postscale_factor,
                                            process_set)
    return _enqueue(submit, list(tensors), copy)


def grouped_allreduce_submit(name: Optional[str], op=Average, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0, process_set=None):
    """(submit, copy) for _enqueue or run_alone: a group's arrays into one request."""
    op, pre, post = ReduceOp(op), float(prescale_factor), float(postscale_factor)
    # No copy of every tensor first, packing the group is the copy (borrowed); device
    # arrays (the GPU path's _to_runtime copies them already) are never copied again.
    borrowed = True
    return (lambda *a: _grouped_allreduce_async(list(a), op, name, pre, post, borrowed=borrowed,
                                                process_set=process_set),
            not borrowed)
