"""horolite as Horovod's `horovod.keras` (standalone Keras, here Keras 3 on TensorFlow).

    import horolite.keras as hvd        # was: import horovod.keras as hvd

The same runtime and wrappers as `horolite.tensorflow.keras`, with the signatures
of `horovod.keras`: its DistributedOptimizer has no local-aggregation keywords,
PartialDistributedOptimizer no `num_groups`, and `allreduce(value, name=None,
average=True, ...)` averages by default (passing `op` then needs `average=None`,
as in Horovod).
"""
from __future__ import annotations

from horolite import (ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built,
                      gloo_enabled, is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
                      mpi_threads_supported, nccl_built, rank, rocm_built, shutdown, size,
                      start_timeline, stop_timeline)
from horolite.core.ops import Adasum, Average, Sum
from horolite.tensorflow import Compression, global_process_set, init
from horolite.tensorflow import keras as _tf_keras
from horolite.tensorflow.keras import (allgather, broadcast, broadcast_global_variables,
                                       load_model, reducescatter)

from . import callbacks, elastic

__all__ = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
           "cross_rank", "cross_size", "mpi_threads_supported", "start_timeline", "stop_timeline",
           "mpi_built", "mpi_enabled", "gloo_built", "gloo_enabled", "nccl_built", "cuda_built",
           "rocm_built", "ddl_built", "ccl_built", "Average", "Sum", "Adasum", "Compression",
           "global_process_set", "callbacks", "elastic", "DistributedOptimizer",
           "PartialDistributedOptimizer", "broadcast_global_variables", "allreduce", "allgather",
           "broadcast", "reducescatter", "load_model"]


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                         compression=Compression.none, sparse_as_dense=False,
                         gradient_predivide_factor=1.0, op=Average, num_groups=0, groups=None):
    """Wrap a Keras optimizer so the gradients it applies are averaged over all ranks
    (see horolite.tensorflow.keras.DistributedOptimizer)."""
    return _tf_keras.DistributedOptimizer(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
        compression=compression, sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=op,
        num_groups=num_groups or None, groups=groups)


def PartialDistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                                compression=Compression.none, sparse_as_dense=False,
                                gradient_predivide_factor=1.0, op=Average, groups=None,
                                process_set=global_process_set, local_layers=None,
                                scale_local_gradients=True):
    """DistributedOptimizer whose `local_layers` keep their own gradients."""
    return _tf_keras.PartialDistributedOptimizer(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
        compression=compression, sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=op, groups=groups,
        process_set=process_set, local_layers=local_layers,
        scale_local_gradients=scale_local_gradients)


def allreduce(value, name=None, average=True, prescale_factor=1.0, postscale_factor=1.0, op=None,
              compression=Compression.none):
    """Horovod's `horovod.keras.allreduce`: averages by default (average=True)."""
    return _tf_keras.allreduce(value, name=name, average=average, prescale_factor=prescale_factor,
                               postscale_factor=postscale_factor, op=op, compression=compression)
