"""Horovod's TensorFlow collectives (`horovod.tensorflow.mpi_ops`), with their gradients.

Each is built on the enqueue/wait ops of `bridge`; the Horovod-compatible
front ends with `average=`, `device_dense=`... are in `horolite.tensorflow`.
"""
from __future__ import annotations

from typing import Callable, List, Optional

import numpy as np
import tensorflow as tf

import horolite as _core
from horolite.errors import HorovodInternalError
from horolite.core.ops import Average, ReduceOp

from . import world_values
from .adasum import check_adasum
from .horovod_basics import HorovodBasics
from .process_sets import check_process_set, global_process_set, set_size
from .bridge import (_enqueue, _guarded, _resolve_name, _run, enqueue_grouped_allreduce,
                     to_tf_error, wait)
from .eager import recording

__all__ = ["allgather", "broadcast", "alltoall", "join", "barrier", "size_op", "rank_op",
           "local_size_op", "local_rank_op", "process_set_included_op", "allgather_with_gradient", "grouped_allgather", "scale"]

_basics = HorovodBasics()  # Horovod's mpi_ops._basics (its tests read process sets through it)


def _as_tensor(tensor) -> tf.Tensor:
    if isinstance(tensor, tf.Variable):
        return tensor.read_value() if not tf.executing_eagerly() else tf.convert_to_tensor(tensor)
    return tf.convert_to_tensor(tensor)


def _check_op(op, process_set=None) -> ReduceOp:
    """The ReduceOp; for Adasum also Horovod's rules, given the process set (None: later)."""
    try:
        op = ReduceOp(op)
    except ValueError:
        raise ValueError(f"unknown reduce op {op!r}") from None
    if op == ReduceOp.ADASUM and process_set is not None:
        check_adasum(process_set)
    return op


def _allreduce_raw(x: tf.Tensor, name, op, pre, post, process_set=global_process_set) -> tf.Tensor:
    return _run(lambda a: _core.allreduce_async(a, op, name, pre, post, process_set=process_set), [x],
                [x.dtype], [x.shape], groupable=True)[0]


def _grad_name(name: Optional[str]) -> Optional[str]:
    return None if name is None else f"{name}.grad"


def _allreduce_dense(tensor: tf.Tensor, op, name, pre, post, process_set=global_process_set) -> tf.Tensor:
    if not recording([tensor]):
        return _allreduce_raw(tensor, name, op, pre, post, process_set)

    @tf.custom_gradient
    def fn(x):
        y = _allreduce_raw(x, name, op, pre, post, process_set)

        def grad(dy):
            return _allreduce_raw(tf.convert_to_tensor(dy), _resolve_name(_grad_name(name), "HorovodAllreduceGrad", dy),
                                  op, pre, post, process_set)
        return y, grad
    return fn(tensor)


def _allreduce(tensor, op=Average, compression=None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, name: Optional[str] = None,
               process_set=global_process_set):
    """Reduce a dense `tensor` (tf.Tensor or tf.Variable) over all ranks (Horovod's
    `mpi_ops._allreduce`; `horolite.tensorflow.allreduce` is the public form)."""
    from .compression import Compression
    compression = compression or Compression.none
    op = _check_op(op, process_set)
    tensor = _as_tensor(tensor)
    name = _resolve_name(name, "HorovodAllreduce", tensor)
    compressed, ctx = compression.compress(tensor)
    reduced = _allreduce_dense(compressed, op, name, float(prescale_factor), float(postscale_factor),
                               process_set)
    return compression.decompress(reduced, ctx)


def _grouped_allreduce(tensors, op=Average, compression=None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0, name: Optional[str] = None,
                       process_set=global_process_set):
    """Allreduce a list of dense tensors as one group (they negotiate and fuse together)."""
    from .compression import Compression
    compression = compression or Compression.none
    op = _check_op(op, process_set)
    tensors = [_as_tensor(t) for t in tensors]
    if not tensors:
        return []
    name = _resolve_name(name, "HorovodGroupedAllreduce", tensors[0])
    pre, post = float(prescale_factor), float(postscale_factor)
    pairs = [compression.compress(t) for t in tensors]

    def reduce_all(xs, nm):
        hid = enqueue_grouped_allreduce(xs, nm, op, pre, post, process_set)
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


def _allgather_raw(x: tf.Tensor, name, process_set=global_process_set) -> tf.Tensor:
    return _allgather_with_rows(x, name, process_set)[0]


def _allgather_with_rows(x: tf.Tensor, name, process_set=global_process_set):
    """(the gathered tensor, every rank's first dimension)."""
    hid = _enqueue(lambda a: _core.allgather_async(a, name, process_set), [x])
    return wait(hid, [x.dtype], [tf.TensorShape([None]).concatenate(x.shape[1:])], with_rows=True)


def allgather(tensor, name: Optional[str] = None, ignore_name_scope: bool = False,
              process_set=global_process_set) -> tf.Tensor:
    """Concatenate every rank's tensor along the first dimension (which may differ per rank).

    Gradient (as in Horovod since 0.22): the upstream gradient averaged over
    ranks, then this rank's rows.
    """
    check_process_set(process_set, "allgather")
    return allgather_with_gradient(tensor, name, ReduceOp.AVERAGE, process_set)


def allgather_with_gradient(tensor, name: Optional[str], grad_op: ReduceOp,
                            process_set=global_process_set) -> tf.Tensor:
    """allgather whose gradient reduces the upstream gradient with `grad_op` (Average for
    Horovod's allgather; Sum where every rank's loss counts, as in SyncBatchNormalization)."""
    tensor = _as_tensor(tensor)
    name = _resolve_name(name, "HorovodAllgather", tensor)

    @tf.custom_gradient
    def fn(x):
        y, rows = _allgather_with_rows(x, name, process_set)
        return y, lambda dy: _allgather_grad(x, dy, rows, name, grad_op, process_set)
    return fn(tensor)


def _allgather_grad(x: tf.Tensor, dy, rows: tf.Tensor, name: Optional[str],
                    op: ReduceOp = ReduceOp.AVERAGE, process_set=global_process_set) -> tf.Tensor:
    """The upstream gradient reduced over ranks with `op`, then this rank's rows
    (found from every rank's first dimension, which the forward allgather learnt)."""
    dy = tf.convert_to_tensor(dy)
    reduced = _allreduce_raw(dy, _resolve_name(_grad_name(name), "HorovodAllgatherGrad", dy),
                             op, 1.0, 1.0, process_set)
    start = tf.reduce_sum(rows[:world_values.set_rank(process_set)])  # (rank when it runs)
    return tf.slice(reduced, tf.concat([[start], tf.zeros([tf.rank(dy) - 1], tf.int64)], 0),
                    tf.shape(x, out_type=tf.int64))


def grouped_allgather(tensors, name: Optional[str] = None, ignore_name_scope: bool = False,
                      process_set=global_process_set) -> List[tf.Tensor]:
    """allgather of each tensor, submitted as one group (one enqueue op; they negotiate together)."""
    check_process_set(process_set, "grouped_allgather")
    return _grouped_along_first_dim(
        tensors, name, "HorovodGroupedAllgather",
        lambda arrays, nm: _core.grouped_allgather_async(arrays, nm, process_set),
        lambda x, dy, rows, nm: _allgather_grad(x, dy, rows, nm, ReduceOp.AVERAGE, process_set),
        with_rows=True)


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


def _broadcast_raw(x: tf.Tensor, root_rank: int, name, process_set=global_process_set) -> tf.Tensor:
    return _run(lambda a: _core.broadcast_async(a, root_rank, name, process_set), [x], [x.dtype],
                [x.shape])[0]


def broadcast(tensor, root_rank: int, name: Optional[str] = None, ignore_name_scope: bool = False,
              process_set=global_process_set) -> tf.Tensor:
    """Every rank gets root_rank's tensor.

    Gradient (as in Horovod since 0.22): the upstream gradient averaged over
    ranks on the root, zeros on the other ranks.
    """
    check_process_set(process_set, "broadcast")
    tensor = _as_tensor(tensor)
    root_rank = int(root_rank)
    name = _resolve_name(name, "HorovodBroadcast", tensor)

    @tf.custom_gradient
    def fn(x):
        y = _broadcast_raw(x, root_rank, name, process_set)

        def grad(dy):
            dy = tf.convert_to_tensor(dy)
            averaged = _allreduce_raw(dy, _resolve_name(_grad_name(name), "HorovodBroadcastGrad", dy),
                                      ReduceOp.AVERAGE, 1.0, 1.0, process_set)
            if not world_values.read_when_run():
                if _core.rank() == root_rank:
                    return averaged
                # Keep the allreduce in the graph on every rank: the root waits for it.
                with tf.control_dependencies([averaged]):
                    return tf.zeros_like(dy)

            def elsewhere():
                with tf.control_dependencies([averaged]):
                    return tf.zeros_like(averaged)
            # In a tf.function, which rank is the root is read when the step runs (an
            # elastic world renumbers its ranks under a traced step).
            return tf.cond(tf.equal(world_values.rank(), root_rank), lambda: averaged,
                           elsewhere)
        return y, grad
    return fn(tensor)


def _alltoall_raw(x: tf.Tensor, splits: Optional[tf.Tensor], name, process_set=global_process_set):
    """Always returns (rows received, splits received): the gradient needs the latter."""
    out_shape = tf.TensorShape([None]).concatenate(x.shape[1:])
    # The set's size when the collective runs (a traced step outlives an elastic world's
    # re-formation): equal parts are cut in submit, and the received splits' length is
    # known statically only eagerly.
    n_now = set_size(process_set) if tf.executing_eagerly() else None

    def submit(a, *s):
        if s:
            return _core.alltoall_async(a, s[0], name, process_set)
        n = set_size(process_set)
        if a.ndim and a.shape[0] % n == 0:  # equal parts, but ask for the received splits too
            return _core.alltoall_async(a, np.full(n, a.shape[0] // n, np.int64), name, process_set)
        return _core.alltoall_async(a, None, name, process_set)  # the runtime reports the error
    inputs = [x] if splits is None else [x, splits]
    out, received = _run(submit, inputs, [x.dtype, tf.int64], [out_shape, [n_now]])
    return out, received


def alltoall(tensor, splits=None, name: Optional[str] = None, ignore_name_scope: bool = False,
             process_set=global_process_set):
    """Send `splits[i]` rows to rank i (equal parts when splits is None).

    Returns the rows received, and with splits given, also the rows received
    from each rank (Horovod >= 0.26 returns both too). Gradient: the alltoall
    of the upstream gradient back along the received splits.
    """
    check_process_set(process_set, "alltoall")
    tensor = _as_tensor(tensor)
    name = _resolve_name(name, "HorovodAlltoall", tensor)
    with_splits = splits is not None
    splits_t = tf.cast(tf.convert_to_tensor(splits), tf.int64) if with_splits else None

    @tf.custom_gradient
    def fn(x):
        out, received = _alltoall_raw(x, splits_t, name, process_set)

        def grad(dy, *_):
            dy = tf.convert_to_tensor(dy)
            back, _ = _alltoall_raw(dy, received, _resolve_name(_grad_name(name), "HorovodAlltoallGrad", dy),
                                    process_set)
            return back
        return (out, received), grad

    out, received = fn(tensor)
    return (out, received) if with_splits else out


def _reducescatter_raw(x: tf.Tensor, op, name, process_set=global_process_set,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> tf.Tensor:
    return _run(lambda a: _core.reducescatter_async(a, op, name, prescale_factor,
                                                    postscale_factor, process_set),
                [x], [x.dtype], [tf.TensorShape([None]).concatenate(x.shape[1:])])[0]


def _reducescatter(tensor, op=Average, name: Optional[str] = None, prescale_factor: float = 1.0,
                   postscale_factor: float = 1.0, process_set=global_process_set) -> tf.Tensor:
    """Reduce over ranks; rank r keeps the r-th part of the first dimension
    (the first rows % size ranks get one extra row). The scale factors multiply
    the input and the result in the runtime, as Horovod's: float16 in float32,
    rounded once per multiply; integers in double, truncated toward zero.

    Gradient (Horovod's): the allgather of the upstream gradient, times size for Sum
    and times both scale factors.
    """
    op = _check_reducescatter_op(op)
    tensor = _as_tensor(tensor)
    name = _resolve_name(name, "HorovodReducescatter", tensor)

    @tf.custom_gradient
    def fn(x):
        return (_reducescatter_raw(x, op, name, process_set, prescale_factor, postscale_factor),
                lambda dy: _reducescatter_grad(dy, op, name, process_set,
                                               (prescale_factor, postscale_factor)))
    return fn(tensor)


def scale(x: tf.Tensor, factor: float) -> tf.Tensor:
    """x * factor in x's dtype (a gradient's scaling, as Horovod's `grad *= factor`);
    integers are scaled in double and truncated toward zero."""
    factor = float(factor)
    if factor == 1.0:
        return x
    if x.dtype.is_integer:
        return tf.cast(tf.cast(x, tf.float64) * factor, x.dtype)
    return x * tf.cast(factor, x.dtype)


def _check_reducescatter_op(op) -> ReduceOp:
    op = _check_op(op)
    if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise ValueError(f"reducescatter supports Average and Sum, not {op.name}")
    return op


def _reducescatter_grad(dy, op: ReduceOp, name: Optional[str],
                        process_set=global_process_set, factors=()) -> tf.Tensor:
    """Horovod's: the allgather of the upstream gradient, times size for Sum, times
    the product of the scale factors."""
    dy = tf.convert_to_tensor(dy)
    if op == ReduceOp.SUM:
        dy = dy * tf.cast(world_values.set_size(process_set), dy.dtype)
    for factor in factors:
        dy = scale(dy, factor)
    return _allgather_raw(dy, _resolve_name(_grad_name(name), "HorovodReducescatterGrad", dy),
                          process_set)


def _grouped_reducescatter(tensors, op=Average, name: Optional[str] = None,
                           prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                           process_set=global_process_set) -> List[tf.Tensor]:
    """reducescatter of each tensor, submitted as one group (one enqueue op)."""
    op = _check_reducescatter_op(op)
    return _grouped_along_first_dim(
        tensors, name, "HorovodGroupedReducescatter",
        lambda arrays, nm: _core.grouped_reducescatter_async(arrays, op, nm, prescale_factor,
                                                             postscale_factor, process_set),
        lambda x, dy, rows, nm: _reducescatter_grad(dy, op, nm, process_set,
                                                    (prescale_factor, postscale_factor)))


def join() -> tf.Tensor:
    """Wait for every rank to join; returns the last rank to join (an int32 tensor)."""
    def fn():
        return np.int32(_core.join())
    if tf.executing_eagerly():
        return tf.constant(_guarded(fn)())
    out = tf.numpy_function(fn, [], tf.int32, stateful=True, name="HorolitJoin")
    out.set_shape([])
    return out


def barrier(process_set=global_process_set):
    """Return once every rank (of the process set) has called barrier() (an op in graphs)."""
    check_process_set(process_set, "barrier")
    if tf.executing_eagerly():
        try:
            _core.barrier(process_set)
        except HorovodInternalError as e:
            raise to_tf_error(e) from e
        return None
    return tf.numpy_function(lambda: (_core.barrier(process_set), np.int32(0))[1], [], tf.int32,
                             stateful=True, name="HorolitBarrier")


def _set_ranks(process_set_id: int) -> list:
    from horolite.api.process_sets import get_process_set_ids_and_ranks
    ranks = get_process_set_ids_and_ranks().get(int(process_set_id))
    if ranks is None:
        raise ValueError("Process set does not exist or has not been registered.")
    return ranks


def size_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    """The number of ranks (of the process set), as an int32 tensor read when it runs
    (in a tf.function too: an elastic world that changed size gives the new size)."""
    _set_ranks(process_set_id)
    return world_values.set_size(int(process_set_id), name)


def process_set_included_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    """1 (int32) when this rank belongs to the process set, else 0 (read when it runs)."""
    _set_ranks(process_set_id)
    return world_values.set_included(process_set_id, name)


def rank_op(name: Optional[str] = None) -> tf.Tensor:
    """This process's rank, as an int32 tensor read when it runs."""
    return world_values.rank(name)


def local_size_op(name: Optional[str] = None) -> tf.Tensor:
    """The number of ranks on this host, as an int32 tensor read when it runs."""
    return world_values.local_size(name)


def local_rank_op(name: Optional[str] = None) -> tf.Tensor:
    """This process's rank on its host, as an int32 tensor read when it runs."""
    return world_values.local_rank(name)
