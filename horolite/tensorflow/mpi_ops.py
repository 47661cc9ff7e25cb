"""The bridge between TensorFlow and the runtime: two Python ops per collective.

Every collective is split into an *enqueue* op, which hands the NumPy array to
the runtime (`horolite.*_async`) and returns at once with an int64 handle id,
and a *wait* op, which synchronizes that handle and returns the result. Both
are `tf.numpy_function` ops marked stateful, so they run eagerly, inside
`tf.function` and in TF1 graphs alike, with pip alone (no compiled TF op).

Splitting matters inside graphs: a caller that reduces many tensors (the
gradient tape, the optimizers) makes every wait op depend on *all* enqueue ops
of the step. Enqueues never block, so no TensorFlow thread can sit in a wait
while a tensor that another rank is waiting for still needs a thread to be
enqueued: no cross-rank deadlock whatever order TensorFlow schedules in. A
step's single request needs no split, and gets one op (`run_alone`).

On a GPU job (NCCL up on every rank) the two ops are `tf.py_function`s instead,
so GPU tensors reach the runtime through DLPack and travel over NCCL without a
host copy; host tensors in the same job still go through NumPy.

Names: an explicit name is used as given in eager mode; in graphs it is made
unique within the graph (`graph.unique_name`), and a missing name is derived
from the input tensor's name there, so ranks that build the same graph agree.
In eager mode a missing name falls back to the runtime's per-kind counters
(ranks must then call in the same order, as in Horovod).
"""
from __future__ import annotations

import itertools
import threading
from typing import Callable, List, Optional, Sequence

import numpy as np
import tensorflow as tf

import horolite as _core
from horolite.collectives import _grouped_allreduce_async
from horolite.errors import HorovodInternalError, NotInitializedError, ShutdownError
from horolite.ops import Average, ReduceOp

__all__ = ["allreduce", "grouped_allreduce", "allgather", "broadcast", "alltoall",
           "reducescatter", "join", "barrier", "size_op", "rank_op", "local_size_op", "local_rank_op",
           "enqueue_allreduce", "enqueue_grouped_allreduce", "grouped_allreduce_submit", "wait",
           "run_alone",
           "to_tf_error", "graph_unique_name"]

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
    """The TensorFlow error for a runtime error raised eagerly: the message (naming the
    tensor) is kept.

    Ranks disagreeing, bad arguments and duplicate names become
    FailedPreconditionError (as in Horovod); a shutdown (or stall) becomes AbortedError.
    Inside graphs the ops leave the runtime's exception alone: TensorFlow turns an
    error raised in a Python op into its own class by the Python type alone
    (ValueError -> InvalidArgumentError, anything else -> UnknownError, an OpError
    included), so the mismatch and argument errors, all ValueErrors, arrive there as
    InvalidArgumentError and a shutdown as UnknownError, each with the message.
    """
    msg = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, ShutdownError):
        return tf.errors.AbortedError(None, None, msg)
    return tf.errors.FailedPreconditionError(None, None, msg)


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
    """A name unique in the current graph (deterministic given the same graph construction)."""
    graph = tf.compat.v1.get_default_graph()
    name = graph.unique_name(base, mark_as_used=True)
    outer = getattr(graph, "name", None) if hasattr(graph, "outer_graph") else None
    return f"{outer}/{name}" if outer else name


def _resolve_name(name: Optional[str], prefix: str, tensor) -> Optional[str]:
    if tf.executing_eagerly():
        return name  # None: the runtime's deterministic counters
    if name is None:
        tname = getattr(tensor, "name", None) or "tensor"
        name = f"{prefix}_{_normalize(tname)}"
    return graph_unique_name(name)


# ---------------------------------------------------- the enqueue/wait ops ----

def _enqueue(submit: Callable, tensors: Sequence[tf.Tensor], copy: bool = True):
    """Run `submit(*arrays) -> Handle` as an op; returns the int64 handle id (a Python int eagerly).

    copy=False only for a submit that copies what it keeps itself (a grouped
    allreduce packs its members, see collectives._grouped_allreduce_async)."""
    # Copy: the runtime keeps the array after this op returns, and must never
    # hold (or be the last to release) memory that TensorFlow owns.
    if _nccl_active():
        # GPU job: tf.py_function hands over the tensors where they live, and GPU
        # tensors go to the runtime through DLPack, so they travel over NCCL.
        def fn(*ts):
            return _store(submit(*[_to_runtime(t) for t in ts]))
        if tf.executing_eagerly():
            return _guarded(fn)(*tensors)
        hid = tf.py_function(fn, list(tensors), tf.int64, name="HorolitEnqueue")
    else:
        def fn(*arrays):
            return _store(submit(*([np.array(a, copy=True) for a in arrays] if copy else arrays)))
        if tf.executing_eagerly():
            return _guarded(fn)(*[t.numpy() for t in tensors])
        hid = tf.numpy_function(fn, list(tensors), tf.int64, stateful=True, name="HorolitEnqueue")
    hid.set_shape([])
    return hid


def _nccl_active() -> bool:
    """True when the runtime moves device arrays over NCCL (every rank has a GPU)."""
    try:
        return _core.basics.runtime().nccl is not None
    except NotInitializedError:
        return False


def _to_runtime(t: tf.Tensor):
    """A GPU tensor as a CuPy copy made on the device (DLPack view, then a device copy:
    TensorFlow may reuse the tensor's memory once the op returns); a host tensor as a
    NumPy copy."""
    if "GPU" in (t.device or ""):
        from horolite.device import tf_to_cupy
        return tf_to_cupy(t).copy()
    return np.array(t.numpy(), copy=True)


def _from_runtime(result, dtype: tf.DType) -> tf.Tensor:
    if hasattr(result, "__cuda_array_interface__"):
        from horolite.device import cupy_to_tf
        return tf.cast(cupy_to_tf(result), dtype)
    return tf.convert_to_tensor(np.asarray(result).astype(dtype.as_numpy_dtype, copy=False))


def wait(hid, dtypes: Sequence[tf.DType], shapes: Sequence, with_rows: bool = False) -> List[tf.Tensor]:
    """The wait op: synchronize handle `hid`; returns one tensor per dtype.

    with_rows (allgathers): then also, per result, every rank's first dimension
    (int64, in rank order), which the gradient needs to find this rank's rows.
    """
    np_dtypes = [d.as_numpy_dtype for d in dtypes]
    if with_rows:
        shapes = list(shapes) + [[_core.size()]] * len(dtypes)
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

    if _nccl_active():
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
        return [tf.convert_to_tensor(r) for r in _guarded(fetch)(hid)]
    outs = tf.numpy_function(fetch, [hid], all_dtypes, stateful=True, name="HorolitWait")
    for out, shape in zip(outs, shapes):
        out.set_shape(shape)
    return list(outs)


def _run(submit: Callable, tensors: Sequence[tf.Tensor], dtypes, shapes) -> List[tf.Tensor]:
    return wait(_enqueue(submit, tensors), dtypes, shapes)


def run_alone(submit: Callable, tensors: Sequence[tf.Tensor], dtypes, shapes,
              copy: bool = True) -> List[tf.Tensor]:
    """Submit and wait in one op, for a collective that is the only one its graph
    waits on (a gradient reducer's single request of a step), so no other enqueue
    can be held up behind its wait. One Python op instead of two saved 0.3 ms a
    step on this VM after a compute-heavy step. GPU jobs and eager calls keep the
    enqueue/wait pair. (TensorFlow converts what fn returns to `dtypes` itself.)"""
    if tf.executing_eagerly() or _nccl_active():
        return wait(_enqueue(submit, tensors, copy), dtypes, shapes)

    def fn(*arrays):
        if copy:
            arrays = [np.array(a, copy=True) for a in arrays]
        return submit(*arrays).result()

    outs = tf.numpy_function(fn, list(tensors), list(dtypes), stateful=True, name="HorolitCollective")
    for out, shape in zip(outs, shapes):
        out.set_shape(shape)
    return outs


def enqueue_allreduce(tensor: tf.Tensor, name: Optional[str], op=Average,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0):
    """Enqueue op only (pair it with `wait(hid, [tensor.dtype], [tensor.shape])`)."""
    op, pre, post = ReduceOp(op), float(prescale_factor), float(postscale_factor)
    return _enqueue(lambda a: _core.allreduce_async(a, op, name, pre, post), [tensor])


def enqueue_grouped_allreduce(tensors: Sequence[tf.Tensor], name: Optional[str], op=Average,
                              prescale_factor: float = 1.0, postscale_factor: float = 1.0):
    """One enqueue op for a group: it runs once every tensor exists, and they fuse together."""
    submit, copy = grouped_allreduce_submit(name, op, prescale_factor, postscale_factor)
    return _enqueue(submit, list(tensors), copy)


def grouped_allreduce_submit(name: Optional[str], op=Average, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0):
    """(submit, copy) for _enqueue or run_alone: a group's arrays into one request."""
    op, pre, post = ReduceOp(op), float(prescale_factor), float(postscale_factor)
    # Host path: no copy of every tensor first, packing the group is the copy
    # (borrowed). The GPU path's _to_runtime copies every tensor already.
    borrowed = not _nccl_active()
    return (lambda *a: _grouped_allreduce_async(list(a), op, name, pre, post, borrowed=borrowed),
            not borrowed)


# ----------------------------------------------------------- collectives ----

def _as_tensor(tensor) -> tf.Tensor:
    if isinstance(tensor, tf.Variable):
        return tensor.read_value() if not tf.executing_eagerly() else tf.convert_to_tensor(tensor)
    return tf.convert_to_tensor(tensor)


def _check_op(op) -> ReduceOp:
    try:
        op = ReduceOp(op)
    except ValueError:
        raise ValueError(f"unknown reduce op {op!r}") from None
    if op == ReduceOp.ADASUM:
        raise ValueError("Adasum is not supported by horolite; use Average or Sum")
    return op


def _allreduce_raw(x: tf.Tensor, name, op, pre, post) -> tf.Tensor:
    return _run(lambda a: _core.allreduce_async(a, op, name, pre, post), [x],
                [x.dtype], [x.shape])[0]


def _grad_name(name: Optional[str]) -> Optional[str]:
    return None if name is None else f"{name}.grad"


def _allreduce_dense(tensor: tf.Tensor, op, name, pre, post) -> tf.Tensor:
    @tf.custom_gradient
    def fn(x):
        y = _allreduce_raw(x, name, op, pre, post)

        def grad(dy):
            return _allreduce_raw(tf.convert_to_tensor(dy), _resolve_name(_grad_name(name), "HorovodAllreduceGrad", dy),
                                  op, pre, post)
        return y, grad
    return fn(tensor)


def allreduce(tensor, op=Average, compression=None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: Optional[str] = None):
    """Reduce `tensor` (tf.Tensor, tf.Variable or tf.IndexedSlices) over all ranks.

    IndexedSlices become two allgathers (values and indices); Average then
    divides the values by the number of ranks. Only Average and Sum are defined
    for IndexedSlices (ValueError otherwise).
    """
    from .compression import Compression
    compression = compression or Compression.none
    op = _check_op(op)
    if isinstance(tensor, tf.IndexedSlices):
        if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
            raise ValueError(f"allreduce of tf.IndexedSlices supports only Average and Sum, not {op.name}; "
                             "pass sparse_as_dense=True to reduce them as dense tensors")
        base = name
        values = allgather(tensor.values, name=None if base is None else f"{base}.values")
        indices = allgather(tensor.indices, name=None if base is None else f"{base}.indices")
        scale = float(prescale_factor) * float(postscale_factor)
        if op == ReduceOp.AVERAGE:
            scale /= _core.size()
        if scale != 1.0:
            values = values * tf.cast(scale, values.dtype)
        return tf.IndexedSlices(values, indices, dense_shape=tensor.dense_shape)
    tensor = _as_tensor(tensor)
    name = _resolve_name(name, "HorovodAllreduce", tensor)
    compressed, ctx = compression.compress(tensor)
    reduced = _allreduce_dense(compressed, op, name, float(prescale_factor), float(postscale_factor))
    return compression.decompress(reduced, ctx)


def grouped_allreduce(tensors, op=Average, compression=None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, name: Optional[str] = None):
    """Allreduce a list of tensors as one group (they negotiate and fuse together)."""
    from .compression import Compression
    compression = compression or Compression.none
    op = _check_op(op)
    tensors = [_as_tensor(t) for t in tensors]
    if not tensors:
        return []
    name = _resolve_name(name, "HorovodGroupedAllreduce", tensors[0])
    pre, post = float(prescale_factor), float(postscale_factor)
    pairs = [compression.compress(t) for t in tensors]

    def reduce_all(xs, nm):
        hid = enqueue_grouped_allreduce(xs, nm, op, pre, post)
        return wait(hid, [x.dtype for x in xs], [x.shape for x in xs])

    @tf.custom_gradient
    def fn(*xs):
        ys = reduce_all(list(xs), name)

        def grad(*dys):
            dys = [tf.convert_to_tensor(d) for d in dys]
            return reduce_all(dys, _resolve_name(_grad_name(name), "HorovodGroupedAllreduceGrad", dys[0]))
        return ys, grad

    reduced = fn(*[c for c, _ in pairs])
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, pairs)]


def _allgather_raw(x: tf.Tensor, name) -> tf.Tensor:
    return _allgather_with_rows(x, name)[0]


def _allgather_with_rows(x: tf.Tensor, name):
    """(the gathered tensor, every rank's first dimension)."""
    hid = _enqueue(lambda a: _core.allgather_async(a, name), [x])
    return wait(hid, [x.dtype], [tf.TensorShape([None]).concatenate(x.shape[1:])], with_rows=True)


def allgather(tensor, name: Optional[str] = None) -> tf.Tensor:
    """Concatenate every rank's tensor along the first dimension (which may differ per rank).

    Gradient (as in Horovod since 0.22): the upstream gradient averaged over
    ranks, then this rank's rows.
    """
    return allgather_with_gradient(tensor, name, ReduceOp.AVERAGE)


def allgather_with_gradient(tensor, name: Optional[str], grad_op: ReduceOp) -> tf.Tensor:
    """allgather whose gradient reduces the upstream gradient with `grad_op` (Average for
    Horovod's allgather; Sum where every rank's loss counts, as in SyncBatchNormalization)."""
    tensor = _as_tensor(tensor)
    name = _resolve_name(name, "HorovodAllgather", tensor)

    @tf.custom_gradient
    def fn(x):
        y, rows = _allgather_with_rows(x, name)
        return y, lambda dy: _allgather_grad(x, dy, rows, name, grad_op)
    return fn(tensor)


def _allgather_grad(x: tf.Tensor, dy, rows: tf.Tensor, name: Optional[str],
                    op: ReduceOp = ReduceOp.AVERAGE) -> tf.Tensor:
    """The upstream gradient reduced over ranks with `op`, then this rank's rows
    (found from every rank's first dimension, which the forward allgather learnt)."""
    dy = tf.convert_to_tensor(dy)
    reduced = _allreduce_raw(dy, _resolve_name(_grad_name(name), "HorovodAllgatherGrad", dy),
                             op, 1.0, 1.0)
    start = tf.reduce_sum(rows[:_core.rank()])
    return tf.slice(reduced, tf.concat([[start], tf.zeros([tf.rank(dy) - 1], tf.int64)], 0),
                    tf.shape(x, out_type=tf.int64))


def grouped_allgather(tensors, name: Optional[str] = None) -> List[tf.Tensor]:
    """allgather of each tensor, submitted as one group (one enqueue op; they negotiate together)."""
    return _grouped_along_first_dim(tensors, name, "HorovodGroupedAllgather",
                                    _core.grouped_allgather_async, _allgather_grad, with_rows=True)


def _grouped_along_first_dim(tensors, name: Optional[str], kind: str, submit: Callable,
                             member_grad: Callable, with_rows: bool = False) -> List[tf.Tensor]:
    """A group of collectives whose results differ from their inputs in the first dimension
    only (allgather, reducescatter): one enqueue op and one wait op for the group;
    member_grad(x, dy, rows, name) is each member's gradient (rows: with_rows' output)."""
    tensors = [_as_tensor(t) for t in tensors]
    if not tensors:
        return []
    name = _resolve_name(name, kind, tensors[0])

    @tf.custom_gradient
    def fn(*xs):
        hid = _enqueue(lambda *a: submit(list(a), name), list(xs))
        outs = wait(hid, [x.dtype for x in xs], [tf.TensorShape([None]).concatenate(x.shape[1:])
                                                 for x in xs], with_rows=with_rows)
        ys, rows = outs[:len(xs)], outs[len(xs):] or [None] * len(xs)

        def grad(*dys):
            return [member_grad(x, dy, r, None if name is None else f"{name}.{i}")
                    for i, (x, dy, r) in enumerate(zip(xs, dys, rows))]
        return ys, grad
    return list(fn(*tensors))


def _broadcast_raw(x: tf.Tensor, root_rank: int, name) -> tf.Tensor:
    return _run(lambda a: _core.broadcast_async(a, root_rank, name), [x], [x.dtype], [x.shape])[0]


def broadcast(tensor, root_rank: int, name: Optional[str] = None) -> tf.Tensor:
    """Every rank gets root_rank's tensor.

    Gradient (as in Horovod since 0.22): the upstream gradient averaged over
    ranks on the root, zeros on the other ranks.
    """
    tensor = _as_tensor(tensor)
    root_rank = int(root_rank)
    name = _resolve_name(name, "HorovodBroadcast", tensor)

    @tf.custom_gradient
    def fn(x):
        y = _broadcast_raw(x, root_rank, name)

        def grad(dy):
            dy = tf.convert_to_tensor(dy)
            averaged = _allreduce_raw(dy, _resolve_name(_grad_name(name), "HorovodBroadcastGrad", dy),
                                      ReduceOp.AVERAGE, 1.0, 1.0)
            if _core.rank() == root_rank:
                return averaged
            # Keep the allreduce in the graph on every rank: the root waits for it.
            with tf.control_dependencies([averaged]):
                return tf.zeros_like(dy)
        return y, grad
    return fn(tensor)


def _alltoall_raw(x: tf.Tensor, splits: Optional[tf.Tensor], name):
    """Always returns (rows received, splits received): the gradient needs the latter."""
    out_shape = tf.TensorShape([None]).concatenate(x.shape[1:])
    n = _core.size()

    def submit(a, *s):
        if s:
            return _core.alltoall_async(a, s[0], name)
        if a.ndim and a.shape[0] % n == 0:  # equal parts, but ask for the received splits too
            return _core.alltoall_async(a, np.full(n, a.shape[0] // n, np.int64), name)
        return _core.alltoall_async(a, None, name)  # the runtime reports the error
    inputs = [x] if splits is None else [x, splits]
    out, received = _run(submit, inputs, [x.dtype, tf.int64], [out_shape, [n]])
    return out, received


def alltoall(tensor, splits=None, name: Optional[str] = None):
    """Send `splits[i]` rows to rank i (equal parts when splits is None).

    Returns the rows received, and with splits given, also the rows received
    from each rank (Horovod >= 0.26 returns both too). Gradient: the alltoall
    of the upstream gradient back along the received splits.
    """
    tensor = _as_tensor(tensor)
    name = _resolve_name(name, "HorovodAlltoall", tensor)
    with_splits = splits is not None
    splits_t = tf.cast(tf.convert_to_tensor(splits), tf.int64) if with_splits else None

    @tf.custom_gradient
    def fn(x):
        out, received = _alltoall_raw(x, splits_t, name)

        def grad(dy, *_):
            dy = tf.convert_to_tensor(dy)
            back, _ = _alltoall_raw(dy, received, _resolve_name(_grad_name(name), "HorovodAlltoallGrad", dy))
            return back
        return (out, received), grad

    out, received = fn(tensor)
    return (out, received) if with_splits else out


def _reducescatter_raw(x: tf.Tensor, op, name) -> tf.Tensor:
    return _run(lambda a: _core.reducescatter_async(a, op, name), [x], [x.dtype],
                [tf.TensorShape([None]).concatenate(x.shape[1:])])[0]


def reducescatter(tensor, op=Average, name: Optional[str] = None) -> tf.Tensor:
    """Reduce over ranks; rank r keeps the r-th part of the first dimension
    (the first rows % size ranks get one extra row).

    Gradient (Horovod's): the allgather of the upstream gradient, times size for Sum.
    """
    op = _check_reducescatter_op(op)
    tensor = _as_tensor(tensor)
    name = _resolve_name(name, "HorovodReducescatter", tensor)

    @tf.custom_gradient
    def fn(x):
        return _reducescatter_raw(x, op, name), lambda dy: _reducescatter_grad(dy, op, name)
    return fn(tensor)


def _check_reducescatter_op(op) -> ReduceOp:
    op = _check_op(op)
    if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise ValueError(f"reducescatter supports Average and Sum, not {op.name}")
    return op


def _reducescatter_grad(dy, op: ReduceOp, name: Optional[str]) -> tf.Tensor:
    """Horovod's: the allgather of the upstream gradient, times size for Sum."""
    dy = tf.convert_to_tensor(dy)
    if op == ReduceOp.SUM:
        dy = dy * tf.cast(_core.size(), dy.dtype)
    return _allgather_raw(dy, _resolve_name(_grad_name(name), "HorovodReducescatterGrad", dy))


def grouped_reducescatter(tensors, op=Average, name: Optional[str] = None) -> List[tf.Tensor]:
    """reducescatter of each tensor, submitted as one group (one enqueue op)."""
    op = _check_reducescatter_op(op)
    return _grouped_along_first_dim(
        tensors, name, "HorovodGroupedReducescatter",
        lambda arrays, nm: _core.grouped_reducescatter_async(arrays, op, nm),
        lambda x, dy, rows, nm: _reducescatter_grad(dy, op, nm))


def join() -> tf.Tensor:
    """Wait for every rank to join; returns the last rank to join (an int32 tensor)."""
    def fn():
        return np.int32(_core.join())
    if tf.executing_eagerly():
        return tf.constant(_guarded(fn)())
    out = tf.numpy_function(fn, [], tf.int32, stateful=True, name="HorolitJoin")
    out.set_shape([])
    return out


def barrier():
    """Return once every rank has called barrier() (an op in graphs)."""
    if tf.executing_eagerly():
        try:
            _core.barrier()
        except HorovodInternalError as e:
            raise to_tf_error(e) from e
        return None
    return tf.numpy_function(lambda: (_core.barrier(), np.int32(0))[1], [], tf.int32,
                             stateful=True, name="HorolitBarrier")


def size_op() -> tf.Tensor:
    return tf.constant(_core.size(), tf.int32)


def rank_op() -> tf.Tensor:
    return tf.constant(_core.rank(), tf.int32)


def local_size_op() -> tf.Tensor:
    return tf.constant(_core.local_size(), tf.int32)


def local_rank_op() -> tf.Tensor:
    return tf.constant(_core.local_rank(), tf.int32)
