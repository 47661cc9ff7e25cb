"""horolite for TensorFlow: Horovod's `horovod.tensorflow` API on the horolite runtime.

    import horolite.tensorflow as hvd   # was: import horovod.tensorflow as hvd
    hvd.init()
    tape = hvd.DistributedGradientTape(tape)

Works eagerly, inside `tf.function` and in TF1 graphs (`tf.compat.v1.Session`):
the collectives are Python ops (`tf.numpy_function`), so pip alone installs it.
"""
from __future__ import annotations

from typing import Optional

import tensorflow as tf

import horolite as _core
from horolite import (ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built,
                      gloo_enabled, is_homogeneous, is_initialized, local_rank, local_size,
                      mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank, rocm_built,
                      shutdown, size, start_timeline, stop_timeline, straggler_report)
from horolite.errors import (AdasumUnsupportedError, DuplicateNameError, HorovodInternalError,
                             InvalidCollectiveError, ShutdownError, StallError, TensorMismatchError)
from horolite.core.ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum

from .compression import Compression
from .legacy_slots import ForwardSlots
from .functions import (allgather_object, broadcast_, broadcast_global_variables, broadcast_object,
                        broadcast_object_fn, broadcast_variables, variable_ref)
from .sync_batch_norm import SyncBatchNormalization
from .aggregation import LocalAggregator
from .gradients import GradientReducer, check_arguments
from .api import (allreduce, grouped_allreduce, grouped_reducescatter,
                  handle_average_backwards_compatibility, reducescatter)
from .adasum import check_adasum
from .mpi_ops import (allgather, alltoall, barrier, broadcast, grouped_allgather, join,
                      local_rank_op, local_size_op, process_set_included_op, rank_op, size_op)
from .process_sets import (ProcessSet, add_process_set, check_process_set, global_process_set,
                           remove_process_set)
from . import elastic, util
from .util import (_cache, _executing_eagerly, _make_subgraph, check_num_rank_power_of_2,
                   gpu_available, refs_to_vars, split_list, vars_to_refs)
from .adasum_optimizer import DistributedAdasumOptimizer
from .wrapper_optimizers import (ElasticAverageOptimizer, ModelAverageOptimizer,
                                 SyncReplicasOptimizer)

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "mpi_threads_supported",
    "start_timeline", "stop_timeline", "straggler_report", "mpi_built", "mpi_enabled", "gloo_built", "gloo_enabled",
    "nccl_built", "cuda_built", "rocm_built", "ddl_built", "ccl_built",
    "ReduceOp", "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "grouped_reducescatter", "broadcast", "alltoall", "reducescatter",
    "join", "barrier", "size_op", "rank_op", "local_size_op", "local_rank_op",
    "process_set_included_op", "Compression", "ProcessSet", "global_process_set",
    "add_process_set", "remove_process_set", "handle_average_backwards_compatibility", "elastic",
    "util", "gpu_available", "check_num_rank_power_of_2", "split_list", "vars_to_refs",
    "refs_to_vars",
    "broadcast_variables", "broadcast_", "broadcast_object", "broadcast_object_fn", "allgather_object",
    "broadcast_global_variables", "BroadcastGlobalVariablesHook",
    "DistributedGradientTape", "PartialDistributedGradientTape", "DistributedOptimizer",
    "SyncBatchNormalization",
    "ModelAverageOptimizer", "ElasticAverageOptimizer", "SyncReplicasOptimizer",
    "HorovodInternalError", "TensorMismatchError", "InvalidCollectiveError", "DuplicateNameError",
    "AdasumUnsupportedError",
    "ShutdownError", "StallError",
]


def init(comm=None, process_sets=None):
    """Start horolite (Horovod's `init(comm=None, process_sets=None)`): `comm` is an mpi4py
    communicator or a list of world ranks; `process_sets` a list of ProcessSet, or
    "dynamic" (see horolite/api/process_sets.py)."""
    _core.init(comm, process_sets)


# ------------------------------------------------------------------ tape ----

# Aggregation state of DistributedGradientTape(backward_passes_per_step > 1):
# the tape is usually created anew every step, so the state outlives it,
# keyed by the variables it aggregates for.
_tape_aggregators = {}


class _DistributedGradientTapeMixin:
    """Mixed into the wrapped tape's own class, so every other method still works."""

    def _horolite_setup(self, reducer: GradientReducer, passes: int, average: bool):
        self._horolite_reducer = reducer
        self._horolite_passes = passes
        self._horolite_average = average

    def register_local_source(self, source):
        """Gradients of `source` stay on this rank, never reduced (divided by size() unless
        scale_local_gradients=False), for model-parallel layers."""
        self._horolite_reducer.register_local(source, "register_local_source")

    def _horolite_aggregator(self, sources) -> LocalAggregator:
        refs = tuple(variable_ref(s) for s in sources)
        if any(r is None for r in refs):
            raise ValueError("backward_passes_per_step > 1 needs variable sources (tf.Variable or "
                             "Keras), since gradients are accumulated in variables of their shape")
        key = (refs, self._horolite_passes, self._horolite_average)
        agg = _tape_aggregators.get(key)
        if agg is None:
            agg = _tape_aggregators[key] = LocalAggregator(self._horolite_passes, self._horolite_average,
                                                           self._horolite_reducer)
        agg.reducer = self._horolite_reducer
        return agg

    def get_local_and_global_gradients(self, target, sources, output_gradients=None,
                                       use_generic_names: bool = False):
        """Horovod's: `gradient()`, split into ([(local source, gradient)...],
        [(reduced source, gradient)...]) in the order of `sources`."""
        grads = self.gradient(target, sources, output_gradients=output_gradients)
        local, reduced = [], []
        for s, g in zip(sources, grads):
            (local if variable_ref(s) in self._horolite_reducer.local_refs else reduced).append((s, g))
        return local, reduced

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE, use_generic_names: bool = False):
        grads = super().gradient(target, sources, output_gradients=output_gradients,
                                 unconnected_gradients=unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads)
        if self._horolite_passes > 1:
            agg = self._horolite_aggregator(flat_sources)
            reduced = agg(flat_grads, flat_sources)
            self.gradients_ready = agg.should_apply() if not tf.executing_eagerly() else \
                bool(agg.counter.numpy() == 0)
        else:
            reduced = self._horolite_reducer(flat_grads, flat_sources)
            self.gradients_ready = True
        return tf.nest.pack_sequence_as(grads, reduced)


def DistributedGradientTape(gradtape, device_dense: str = "", device_sparse: str = "",
                            compression=Compression.none, sparse_as_dense: bool = False, op=Average,
                            gradient_predivide_factor: float = 1.0, num_groups=None, groups=None,
                            process_set=global_process_set, scale_local_gradients: bool = True,
                            backward_passes_per_step: int = 1,
                            average_aggregated_gradients: bool = False):
    """Wrap a tf.GradientTape so `gradient()` returns gradients reduced over all ranks.

    Gradients of None stay None; sources registered with
    `register_local_source` keep their local gradient (divided by size(), as
    Horovod does, unless scale_local_gradients=False). With
    `backward_passes_per_step=N > 1` (beyond Horovod), gradients are summed
    locally and reduced on every N-th call only; the other calls return zeros,
    and `tape.gradients_ready` says whether this call's result is the reduced
    one (a bool, or a bool tensor inside graphs).
    """
    check_arguments(op, gradient_predivide_factor, backward_passes_per_step)
    reducer = GradientReducer("DistributedGradientTape", compression, sparse_as_dense, op,
                              gradient_predivide_factor, num_groups, groups, scale_local_gradients,
                              process_set)
    cls = type(gradtape.__class__.__name__, (_DistributedGradientTapeMixin, gradtape.__class__), {})
    tape = cls.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)
    tape._horolite_setup(reducer, int(backward_passes_per_step), average_aggregated_gradients)
    return tape


def _local_layer_variables(local_layers, what: str) -> list:
    """The trainable variables of `local_layers` (a Keras layer, a list of them, or None)."""
    if local_layers is None:
        return []
    layers = [local_layers] if isinstance(local_layers, tf.keras.layers.Layer) else list(local_layers)
    for layer in layers:
        if not isinstance(layer, tf.keras.layers.Layer):
            raise ValueError(f"{what}: local_layers must be Keras layers, got {type(layer).__name__}")
    return [v for layer in layers for v in layer.trainable_weights]


def PartialDistributedGradientTape(gradtape, device_dense: str = "", device_sparse: str = "",
                                   compression=Compression.none, sparse_as_dense: bool = False,
                                   op=Average, gradient_predivide_factor: float = 1.0,
                                   num_groups=None, groups=None, process_set=global_process_set,
                                   local_layers=None, scale_local_gradients: bool = True):
    """DistributedGradientTape whose `local_layers` (model-parallel layers) keep their
    own gradients: every trainable variable of theirs is a registered local source."""
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                   groups, process_set, scale_local_gradients)
    for var in _local_layer_variables(local_layers, "PartialDistributedGradientTape"):
        tape.register_local_source(var)
    return tape


# ----------------------------------------------------- legacy optimizer ----

class _DistributedOptimizer(ForwardSlots, tf.compat.v1.train.Optimizer):
    """Wraps a tf.compat.v1.train.Optimizer: compute_gradients reduces, apply_gradients applies."""

    def __init__(self, optimizer, name=None, use_locking=False, compression=Compression.none,
                 sparse_as_dense=False, backward_passes_per_step=1, op=Average,
                 gradient_predivide_factor=1.0, average_aggregated_gradients=False, num_groups=None,
                 groups=None, scale_local_gradients=True, process_set=global_process_set):
        if name is None:
            name = f"Distributed{type(optimizer).__name__}"
        check_arguments(op, gradient_predivide_factor, backward_passes_per_step)
        super().__init__(name=name, use_locking=use_locking)
        self._optimizer = optimizer
        self._reducer = GradientReducer(name, compression, sparse_as_dense, op,
                                        gradient_predivide_factor, num_groups, groups,
                                        scale_local_gradients, process_set)
        self._aggregator = (LocalAggregator(backward_passes_per_step, average_aggregated_gradients,
                                            self._reducer)
                            if backward_passes_per_step > 1 else None)

    def register_local_var(self, var):
        """`var`'s gradient stays on this rank, never reduced (see DistributedGradientTape)."""
        self._reducer.register_local(var, "register_local_var")

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's (gradient, variable) pairs with the gradients reduced.

        With backward_passes_per_step=N > 1: on the N-th call, the reduced sum
        (or mean, with average_aggregated_gradients) of the N local gradients;
        on the other calls, zeros of each variable's shape (None stays None).
        """
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        if not pairs:
            return pairs
        grads, variables = zip(*pairs)
        if self._aggregator is not None:
            reduced = self._aggregator(list(grads), list(variables))
        else:
            reduced = self._reducer(list(grads), list(variables))
        return list(zip(reduced, variables))

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """Apply; with backward_passes_per_step > 1, only right after a communicating call."""
        grads_and_vars = list(grads_and_vars)
        if self._aggregator is None:
            return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step, name=name)
        if tf.executing_eagerly():
            if int(self._aggregator.counter.numpy()) == 0:
                return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step, name=name)
            return None
        deps = [g.values if isinstance(g, tf.IndexedSlices) else g for g, _ in grads_and_vars if g is not None]
        with tf.control_dependencies(deps):
            ready = self._aggregator.should_apply()

        def apply():
            op = self._optimizer.apply_gradients(grads_and_vars, global_step=global_step, name=name)
            with tf.control_dependencies([op]):
                return tf.constant(True)

        return tf.group(tf.cond(ready, apply, lambda: tf.constant(False)))


def DistributedOptimizer(optimizer, name: Optional[str] = None, use_locking: bool = False,
                         device_dense: str = "", device_sparse: str = "",
                         compression=Compression.none, sparse_as_dense: bool = False,
                         backward_passes_per_step: int = 1, op=Average,
                         gradient_predivide_factor: float = 1.0,
                         average_aggregated_gradients: bool = False, num_groups=None,
                         groups=None, process_set=global_process_set, scale_local_gradients: bool = True):
    """Horovod's DistributedOptimizer: a tf.compat.v1.train.Optimizer (legacy, graph or eager)
    or a Keras optimizer (then see horolite.tensorflow.keras.DistributedOptimizer)."""
    if ReduceOp(op) == ReduceOp.ADASUM:  # Horovod's rules for Adasum
        if average_aggregated_gradients:
            raise ValueError("Adasum does not support average_aggregated_gradients == True")
        if not isinstance(optimizer, tf.compat.v1.train.Optimizer):
            raise ValueError("op == Adasum is not supported yet with Keras (use "
                             "horolite.tensorflow.keras.DistributedOptimizer, which reduces the "
                             "gradients with Adasum)")
        check_adasum(process_set)  # (NotImplementedError: a process set, a count not 2^k)
        return DistributedAdasumOptimizer(optimizer, name, use_locking, compression,
                                          backward_passes_per_step)
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        return _DistributedOptimizer(optimizer, name, use_locking, compression, sparse_as_dense,
                                     backward_passes_per_step, op, gradient_predivide_factor,
                                     average_aggregated_gradients, num_groups, groups,
                                     scale_local_gradients, process_set)
    from . import keras as _keras
    return _keras.DistributedOptimizer(
        optimizer, name=name, compression=compression, sparse_as_dense=sparse_as_dense,
        backward_passes_per_step=backward_passes_per_step, op=op,
        gradient_predivide_factor=gradient_predivide_factor,
        average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups,
        groups=groups, process_set=process_set, scale_local_gradients=scale_local_gradients)


# ------------------------------------------------------------- TF1 hook ----

class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """TF1: broadcast every global variable from root_rank once the session exists
    (use with MonitoredTrainingSession), so all ranks start from the same state."""

    def __init__(self, root_rank: int, device: str = ""):
        super().__init__()
        self.root_rank = root_rank
        self.bcast_op = None

    def begin(self):
        if self.bcast_op is None or self.bcast_op.graph != tf.compat.v1.get_default_graph():
            self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session, coord):
        session.run(self.bcast_op)
