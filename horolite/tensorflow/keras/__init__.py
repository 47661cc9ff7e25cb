"""horolite for Keras 3 (TensorFlow backend): Horovod's `horovod.tensorflow.keras` API.

    import horolite.tensorflow.keras as hvd
    hvd.init()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size())),
                  loss=..., jit_compile=False)
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                               hvd.callbacks.MetricAverageCallback()])

The collectives are Python ops, which XLA cannot compile: compile() turns XLA off
(with one warning) for a model whose optimizer is a DistributedOptimizer (see keras_hooks).
"""
from __future__ import annotations

import tensorflow as tf
import keras

from . import backup_restore, keras_hooks

keras_hooks.check_keras_version()

from horolite import (ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built,
                      gloo_enabled, is_homogeneous, is_initialized, local_rank, local_size,
                      mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank, rocm_built,
                      shutdown, size, start_timeline, stop_timeline)
from horolite.core.ops import Adasum, Average, Max, Min, Product, Sum

from .. import (Compression, ProcessSet, SyncBatchNormalization, _local_layer_variables,
                add_process_set, allgather_object, broadcast_object, broadcast_variables,
                check_process_set, global_process_set, grouped_allgather, grouped_allreduce,
                grouped_reducescatter, init, join, remove_process_set)
from .. import allgather as _allgather, allreduce as _allreduce, broadcast as _broadcast
from .. import reducescatter as _reducescatter
from ..aggregation import LocalAggregator
from ..gradients import GradientReducer, after_all, check_arguments
from ..wrapper_optimizers import (ElasticAverageOptimizer, ModelAverageOptimizer,
                                  SyncReplicasOptimizer)
from . import callbacks, elastic

__all__ = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
           "cross_rank", "cross_size", "is_homogeneous", "mpi_threads_supported",
           "start_timeline", "stop_timeline", "mpi_built", "mpi_enabled", "gloo_built",
           "gloo_enabled", "nccl_built", "cuda_built", "rocm_built", "ddl_built", "ccl_built",
           "Average", "Sum", "Adasum", "Min",
           "Max", "Product", "Compression", "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "grouped_reducescatter",
           "broadcast", "reducescatter", "join", "broadcast_variables", "broadcast_object", "allgather_object",
           "DistributedOptimizer", "PartialDistributedOptimizer", "SyncBatchNormalization", "load_model", "callbacks", "elastic", "broadcast_global_variables",
           "ModelAverageOptimizer", "ElasticAverageOptimizer", "SyncReplicasOptimizer",
           "ProcessSet", "global_process_set", "add_process_set", "remove_process_set"]


class _VariableList(list):
    """Keras 3's `optimizer.variables` (a list), also callable as TF 2's `variables()` was:
    Horovod-era code such as `hvd.broadcast_variables(opt.variables(), 0)` runs unchanged."""

    def __call__(self):
        return list(self)


class _DistributedMixin:
    """Mixed into the wrapped optimizer's class: `apply` reduces the gradients first."""

    @property
    def variables(self):
        return _VariableList(super().variables)

    @property
    def lr(self):
        """Keras 2's name of `learning_rate` (Horovod-era callbacks and scripts read it)."""
        return self.learning_rate

    @lr.setter
    def lr(self, value):
        self.learning_rate = value

    def _horolite_setup(self, reducer, passes, average):
        self._horolite_reducer = reducer
        self._horolite_aggregator = LocalAggregator(passes, average, reducer) if passes > 1 else None

    def register_local_var(self, var):
        """`var`'s gradient stays on this rank, never reduced (divided by size() unless
        scale_local_gradients=False), for model-parallel layers."""
        self._horolite_reducer.register_local(var, "register_local_var")

    def apply(self, grads, trainable_variables=None):
        variables = list(trainable_variables) if trainable_variables is not None else list(self._trainable_variables)
        grads = list(grads)
        if self._horolite_aggregator is None:
            if not self.built and trainable_variables is not None:
                # Built here, before the barrier below: built under it, the slots'
                # initializers depend on the gradients, tf.function cannot lift them and
                # runs the step through a second trace under other request names.
                with keras.name_scope(self.name, caller=self):
                    self.build(variables)
                self.built = True
            reduced = self._horolite_reducer(grads, variables)
            if tf.executing_eagerly():
                return super().apply(reduced, trainable_variables)
            # All of the update (`iterations` too, which needs no gradient) after every
            # gradient: a step that fails at one of its buckets changes nothing, anywhere.
            with tf.control_dependencies(after_all([g.values if isinstance(g, tf.IndexedSlices) else g
                                                    for g in reduced if g is not None])):
                return super().apply(reduced, trainable_variables)
        if not self.built:
            self.build(variables)
            self.built = True
        reduced = self._horolite_aggregator(grads, variables)
        if tf.executing_eagerly():
            if int(self._horolite_aggregator.counter.numpy()) == 0:
                return super().apply(reduced, trainable_variables)
            self._iterations.assign_add(1)  # as Horovod: iterations counts every batch
            return None
        deps = [g for g in reduced if g is not None]
        with tf.control_dependencies(deps):
            ready = self._horolite_aggregator.should_apply()

        def do_apply():
            super(_DistributedMixin, self).apply(reduced, trainable_variables)
            return tf.constant(True)

        def skip():
            self._iterations.assign_add(1)
            return tf.constant(False)
        tf.cond(ready, do_apply, skip)


keras_hooks.install(_DistributedMixin)
backup_restore.install()


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                         compression=Compression.none, sparse_as_dense=False,
                         gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1,
                         average_aggregated_gradients=False, num_groups=None, groups=None,
                         process_set=global_process_set, scale_local_gradients=True):
    """Wrap a Keras 3 optimizer so the gradients it applies are reduced over all ranks.

    Returns an instance of a subclass of the optimizer's own class with the
    same configuration (so it works in `model.compile`/`fit` and saves like
    the original). With backward_passes_per_step=N > 1 the gradients of N
    batches are summed locally (divided by N with average_aggregated_gradients)
    and reduced and applied on every N-th batch; `iterations` still counts
    every batch, as in Horovod.
    """
    check_arguments(op, gradient_predivide_factor, backward_passes_per_step)
    reducer = GradientReducer(name or f"Distributed{type(optimizer).__name__}", compression,
                              sparse_as_dense, op, gradient_predivide_factor, num_groups, groups,
                              scale_local_gradients, process_set)
    new = _distributed_class(type(optimizer)).from_config(optimizer.get_config())
    new._horolite_setup(reducer, int(backward_passes_per_step), average_aggregated_gradients)
    return new


def PartialDistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                                compression=Compression.none, sparse_as_dense=False,
                                gradient_predivide_factor=1.0, op=Average,
                                backward_passes_per_step=1, average_aggregated_gradients=False,
                                num_groups=None, groups=None, process_set=global_process_set,
                                local_layers=None, scale_local_gradients=True):
    """DistributedOptimizer whose `local_layers` (model-parallel layers) keep their own
    gradients: every trainable variable of theirs is a registered local variable."""
    new = DistributedOptimizer(optimizer, name, device_dense, device_sparse, compression,
                               sparse_as_dense, gradient_predivide_factor, op,
                               backward_passes_per_step, average_aggregated_gradients,
                               num_groups, groups, process_set, scale_local_gradients)
    for var in _local_layer_variables(local_layers, "PartialDistributedOptimizer"):
        new.register_local_var(var)
    return new


_classes = {}


def _distributed_class(base: type) -> type:
    """The subclass of optimizer class `base` that reduces gradients first, one per class.

    It carries base's module and name, so a saved model names the class it
    wrapped: keras.models.load_model gives that plain optimizer back (as it does
    for Horovod's), and load_model below wraps it again."""
    cls = _classes.get(base)
    if cls is None:
        cls = _classes[base] = type(base.__name__, (_DistributedMixin, base),
                                    {"__module__": base.__module__, "__qualname__": base.__qualname__})
    return cls


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none,
               legacy_opts=False):
    """keras.models.load_model, with the saved optimizer wrapped in DistributedOptimizer.

    The optimizer keeps the state it was saved with (iterations, slots), so
    training resumes where it stopped. custom_optimizers: optimizer classes of
    your own that the file names (added to custom_objects by class name).
    legacy_opts=True (Horovod's tf.keras.optimizers.legacy) is refused: Keras 3 has none."""
    if legacy_opts:
        raise NotImplementedError("load_model(legacy_opts=True): Keras 3 has no legacy optimizers "
                                  "(tf.keras.optimizers.legacy); load with legacy_opts=False")
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or ():
        objects.setdefault(cls.__name__, cls)
    model = tf.keras.models.load_model(filepath, custom_objects=objects)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not isinstance(optimizer, _DistributedMixin):
        # Wrapped in place, not rebuilt from its config: that would drop its state.
        optimizer.__class__ = _distributed_class(type(optimizer))
        optimizer._horolite_setup(GradientReducer(f"Distributed{type(optimizer).__name__}",
                                                  compression), 1, False)
    return model


def broadcast_global_variables(root_rank):
    raise RuntimeError("Keras 3 has no global variables: use "
                       "broadcast_variables(model.variables, root_rank) or "
                       "callbacks.BroadcastGlobalVariablesCallback(root_rank)")


def _value(value, name):
    return value if isinstance(value, (tf.Tensor, tf.Variable)) else tf.constant(value, name=name)


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None,
              compression=Compression.none):
    """Horovod's Keras allreduce of a value (a NumPy array, number or tensor)."""
    return _allreduce(_value(value, name), average=average, prescale_factor=prescale_factor,
                      postscale_factor=postscale_factor, op=op, compression=compression)


def allgather(value, name=None):
    """Horovod's Keras allgather of a value along its first dimension."""
    return _allgather(_value(value, name))


def broadcast(value, root_rank, name=None):
    """Horovod's Keras broadcast of a value from root_rank."""
    return _broadcast(_value(value, name), root_rank)


def reducescatter(value, name=None, op=Average):
    """Horovod's Keras reducescatter of a value."""
    return _reducescatter(_value(value, name), op=op)
