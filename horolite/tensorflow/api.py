"""The reducing collectives with Horovod 0.28.1's exact signatures (`horovod.tensorflow`).

Same positional order, names and defaults as Horovod: `allreduce(tensor, average=None,
device_dense='', device_sparse='', compression=..., op=None, ...)`, so
`allreduce(x, True)` averages and `allreduce(x, False)` sums, as there. `op=None`
means Average; `average` is Horovod's deprecated spelling (both at once is a
ValueError). tf.IndexedSlices are reduced as Horovod does: two allgathers
(values and indices), the values divided by size() for Average (integer values
then become float64, as with Horovod's `values / size`); Min, Max, Product and
Adasum raise NotImplementedError (dense tensors take Adasum: horolite/transport/adasum.py). Devices are TensorFlow's to choose here:
`device_dense`/`device_sparse` place the ops as in Horovod.
"""
from __future__ import annotations

import warnings
from typing import Optional

import tensorflow as tf

from horolite.core.ops import Average, ReduceOp, Sum

from .compression import Compression
from .mpi_ops import (_allreduce, _grouped_allreduce, _grouped_reducescatter, _reducescatter,
                      allgather, grouped_allgather)
from . import world_values
from .process_sets import check_process_set, global_process_set

__all__ = ["allreduce", "grouped_allreduce", "reducescatter", "grouped_reducescatter",
           "handle_average_backwards_compatibility"]


def handle_average_backwards_compatibility(op, average):
    """Horovod's rule: `op` wins; `average` alone maps True -> Average, False -> Sum;
    neither -> Average; both -> ValueError."""
    if op is not None:
        if average is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of them.")
        return op
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in v1.0",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    return Average


def _check_sparse_op(op, prescale_factor, postscale_factor) -> None:
    if ReduceOp(op) == ReduceOp.ADASUM:
        raise NotImplementedError("The Adasum reduction does not currently support sparse tensors. "
                                  "As a workaround please pass sparse_as_dense=True to "
                                  "DistributedOptimizer")
    if ReduceOp(op) not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        raise NotImplementedError("Only Sum and Average ops are supported with tf.IndexedSlices")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices")


def _average_values(values: tf.Tensor, op, process_set=global_process_set) -> tf.Tensor:
    if ReduceOp(op) != ReduceOp.AVERAGE:
        return values
    # The set's size when the step runs: a traced step outlives an elastic re-formation.
    return values / tf.cast(world_values.set_size(process_set), values.dtype)


def allreduce(tensor, average=None, device_dense: str = "", device_sparse: str = "",
              compression=Compression.none, op=None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: Optional[str] = None,
              process_set=global_process_set, ignore_name_scope: bool = False):
    """Reduce a tf.Tensor, tf.Variable or tf.IndexedSlices over all ranks (Average by default)."""
    check_process_set(process_set, "allreduce")
    op = handle_average_backwards_compatibility(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        _check_sparse_op(op, prescale_factor, postscale_factor)
        with tf.device(device_sparse):
            values = allgather(tensor.values, name=None if name is None else f"{name}.values",
                               process_set=process_set)
            indices = allgather(tensor.indices, name=None if name is None else f"{name}.indices",
                                process_set=process_set)
            return tf.IndexedSlices(_average_values(values, op, process_set), indices,
                                    dense_shape=tensor.dense_shape)
    with tf.device(device_dense):
        return _allreduce(tensor, op, compression, prescale_factor, postscale_factor, name,
                          process_set)


def grouped_allreduce(tensors, average=None, device_dense: str = "", device_sparse: str = "",
                      compression=Compression.none, op=None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set=global_process_set,
                      ignore_name_scope: bool = False, name: Optional[str] = None):
    """allreduce of every tensor, submitted together (dense ones fuse into one request);
    tf.IndexedSlices among them become grouped allgathers, as in Horovod."""
    if not tensors:
        return tensors
    check_process_set(process_set, "grouped_allreduce")
    op = handle_average_backwards_compatibility(op, average)
    out = [None] * len(tensors)
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    if sparse:
        _check_sparse_op(op, prescale_factor, postscale_factor)
        with tf.device(device_sparse):
            base = None if name is None else f"{name}.sparse"
            values = grouped_allgather([tensors[i].values for i in sparse],
                                       name=None if base is None else f"{base}.values",
                                       process_set=process_set)
            indices = grouped_allgather([tensors[i].indices for i in sparse],
                                        name=None if base is None else f"{base}.indices",
                                        process_set=process_set)
            for i, v, ix in zip(sparse, values, indices):
                out[i] = tf.IndexedSlices(_average_values(v, op, process_set), ix,
                                          dense_shape=tensors[i].dense_shape)
    if dense:
        with tf.device(device_dense):
            reduced = _grouped_allreduce([tensors[i] for i in dense], op, compression, prescale_factor,
                                         postscale_factor, name, process_set)
        for i, r in zip(dense, reduced):
            out[i] = r
    return out


def reducescatter(tensor, device_dense: str = "", compression=Compression.none, op=Average,
                  name: Optional[str] = None, process_set=global_process_set,
                  ignore_name_scope: bool = False, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0):
    """Reduce over ranks, rank r keeping part r of the first dimension (Average or Sum)."""
    check_process_set(process_set, "reducescatter")
    with tf.device(device_dense):
        compressed, ctx = compression.compress(tf.convert_to_tensor(tensor))
        reduced = _reducescatter(compressed, op, name, prescale_factor, postscale_factor,
                                 process_set)
        return compression.decompress(reduced, ctx)


def grouped_reducescatter(tensors, device_dense: str = "", compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0, name: Optional[str] = None):
    """reducescatter of every tensor, submitted as one group."""
    if not tensors:
        return tensors
    check_process_set(process_set, "grouped_reducescatter")
    with tf.device(device_dense):
        pairs = [compression.compress(tf.convert_to_tensor(t)) for t in tensors]
        reduced = _grouped_reducescatter([c for c, _ in pairs], op, name, prescale_factor,
                                         postscale_factor, process_set)
        return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, pairs)]

