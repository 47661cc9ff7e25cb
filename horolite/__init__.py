"""horolite: Horovod-style data-parallel training runtime (ring allreduce over MPI).

    import horolite as hvd
    hvd.init()
    avg = hvd.allreduce(np.ones(4), name="grad")

Importing horolite does not import TensorFlow, CuPy or even MPI: MPI starts at init().
"""
from .api.basics import (cross_rank, cross_size, init, is_homogeneous, is_initialized, local_rank,
                         local_size, mpi_threads_supported, rank, shutdown, size, start_timeline,
                         stop_timeline)
from .api.capabilities import (ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled, mpi_built,
                               mpi_enabled, nccl_built, rocm_built)
from .api.collectives import (allgather, allgather_async, allreduce, allreduce_async, alltoall,
                              alltoall_async, barrier, broadcast, broadcast_async, grouped_allgather,
                              grouped_allgather_async, grouped_allreduce, grouped_allreduce_async,
                              grouped_reducescatter, grouped_reducescatter_async, join, join_async, poll, reducescatter, reducescatter_async,
                              synchronize)
from .errors import (AdasumUnsupportedError, DuplicateNameError, HorovodInternalError,
                     InvalidCollectiveError, NotInitializedError, ShutdownError, StallError, TensorMismatchError)
from .core.handle import Handle
from .api.buckets import GradientBuckets
from .api.objects import broadcast_object
from .api.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from .api.stragglers import straggler_report
from .core.ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum

from .core.mpi_library import MPILibraryNotFound
from .version import __version__

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "mpi_threads_supported",
    "start_timeline", "stop_timeline", "straggler_report", "mpi_built", "mpi_enabled", "gloo_built", "gloo_enabled",
    "nccl_built", "cuda_built", "rocm_built", "ddl_built", "ccl_built",
    "allreduce", "allreduce_async", "grouped_allreduce", "grouped_allreduce_async",
    "allgather", "allgather_async", "broadcast", "broadcast_async", "alltoall", "alltoall_async",
    "broadcast_object", "reducescatter", "reducescatter_async", "grouped_allgather", "grouped_allgather_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "barrier", "join", "join_async", "poll", "synchronize", "Handle",
    "GradientBuckets",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "ReduceOp", "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "HorovodInternalError", "TensorMismatchError", "InvalidCollectiveError", "DuplicateNameError",
    "AdasumUnsupportedError",
    "ShutdownError", "StallError", "NotInitializedError", "MPILibraryNotFound", "__version__",
]
