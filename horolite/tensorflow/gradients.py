"""Reducing a step's gradients: one request, or buckets that leave while backprop runs.

`GradientReducer` is what DistributedGradientTape and both DistributedOptimizers
share. It enqueues every gradient as soon as it exists (in reverse list order,
since backprop produces the last layers' gradients first) and only then waits:
every wait op has a control dependency on all the enqueue ops of the step.
When the step makes one request (the default: one group), a graph gets one op
that submits and waits, since there is no other enqueue to hold up.

Local gradient aggregation (`backward_passes_per_step`) is in aggregation.py.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import tensorflow as tf

import horolite as _core
from horolite.api import buckets
from horolite.core.ops import ReduceOp

from .compression import Compression
from .functions import variable_name, variable_ref
from .bridge import (_enqueue, across_traces, graph_unique_name, grouped_allreduce_submit,
                     run_alone, wait)
from .adasum import check_adasum
from .bucket_order import BucketOrder
from . import update_barrier, world_values
from .update_barrier import after_all
from .bucket_slots import naming_members, placeholder, slot_nbytes, sparse_marker
from .mpi_ops import _check_op
from .process_sets import check_process_set, global_process_set, reduces_here, set_size

__all__ = ["GradientReducer", "check_arguments", "after_all"]


def check_arguments(op, gradient_predivide_factor: float, backward_passes_per_step: int = 1):
    """Validate the constructor arguments shared by the tape and the optimizers."""
    op = _check_op(op)
    if gradient_predivide_factor != 1.0 and op != ReduceOp.AVERAGE:
        raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor} is only supported "
                         f"with op=Average, not {op.name}")
    if gradient_predivide_factor <= 0:
        raise ValueError(f"gradient_predivide_factor must be positive, got {gradient_predivide_factor}")
    if int(backward_passes_per_step) < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    return op


class GradientReducer:
    def __init__(self, name: str, compression=Compression.none, sparse_as_dense: bool = False,
                 op=ReduceOp.AVERAGE, gradient_predivide_factor: float = 1.0, num_groups=None,
                 groups=None, scale_local_gradients: bool = True, process_set=global_process_set):
        self.op = check_arguments(op, gradient_predivide_factor)
        if self.op == ReduceOp.ADASUM:
            check_adasum(process_set)
        self.name = name
        # Gradients are reduced over this set; on a rank outside it (or a set of one
        # rank) they stay local, as in Horovod.
        self.process_set = process_set
        if process_set is not None and process_set.included() is not False:
            check_process_set(process_set, name)
        # Local variables (register_local_source/_var, local_layers) keep their own
        # gradient; Horovod divides it by size() so that it belongs to the same
        # (averaged) loss as the reduced ones.
        self.local_refs = set()
        self.scale_local_gradients = bool(scale_local_gradients)
        self.compression = compression or Compression.none
        self.sparse_as_dense = sparse_as_dense
        if self.op == ReduceOp.AVERAGE:
            # The runtime divides by size for Average; split the rest around the sum.
            self.prescale = 1.0 / gradient_predivide_factor
            self.postscale = float(gradient_predivide_factor)
        else:
            self.prescale = self.postscale = 1.0
        if isinstance(groups, int):
            num_groups, groups = groups, None
        if num_groups is not None and num_groups < 0:
            raise ValueError(f"num_groups must be >= 0, got {num_groups}")
        # None (the default): a step's dense gradients travel as one grouped request, so
        # the background thread needs one cycle per step, not one per gradient; the
        # results are the same. 0: one request per gradient (Horovod's default), which lets
        # a gradient's exchange start while backprop is still computing the others.
        self.num_groups = None if num_groups is None and groups is None else int(num_groups or 0)
        if groups is not None:
            refs = [[variable_ref(v) for v in group] for group in groups]
            for group, group_refs in zip(groups, refs):
                for v, ref in zip(group, group_refs):
                    if ref is None:
                        raise ValueError(f"groups: expected lists of variables (tf.Variable or "
                                         f"Keras), got {type(v).__name__} {v!r:.80}")
            groups = refs
            seen = [r for group in groups for r in group]
            if len(seen) != len(set(seen)):
                raise ValueError("groups: a variable appears in more than one group")
        self.groups = groups

    def register_local(self, var, what: str):
        """Keep `var`'s gradient on this rank: never reduced, divided by size() if scaling."""
        ref = variable_ref(var)
        if ref is None:
            raise ValueError(f"{what}: expected a variable (tf.Variable or Keras), "
                             f"got {type(var).__name__}")
        self.local_refs.add(ref)

    def _is_local(self, variables, n: int) -> List[bool]:
        if not self.local_refs or variables is None:
            return [False] * n
        return [variable_ref(variables[i]) in self.local_refs for i in range(n)]

    def _scale_local(self, grads, local) -> None:
        if not self.scale_local_gradients or not any(local):
            return
        # The set's size when the step runs (an elastic world changes it under a traced
        # step); eagerly a constant, and nothing to divide by at one rank.
        if tf.executing_eagerly() and set_size(self.process_set) == 1:
            return
        n = world_values.set_size(self.process_set)
        for i, g in enumerate(grads):
            if local[i] and g is not None:
                if isinstance(g, tf.IndexedSlices):
                    grads[i] = tf.IndexedSlices(g.values / tf.cast(n, g.values.dtype), g.indices,
                                                g.dense_shape)
                else:
                    grads[i] = g / tf.cast(n, g.dtype)

    # -- planning --
    def _group_indices(self, dense: List[int], variables, grads, graph: bool) -> List[List[int]]:
        """Which dense gradients travel together (one enqueue op per group). By default
        (`dense` then holds the positions of None gradients too) buckets in a graph, one
        group eagerly: eager ops run one by one, so there is no backprop to overlap."""
        if self.groups is not None:
            where = {ref: k for k, group in enumerate(self.groups) for ref in group}
            by_group = {}
            singles = []
            for i in dense:
                var = variables[i] if variables is not None else None
                ref = variable_ref(var)
                k = where.get(ref) if ref is not None else None
                if k is None:
                    singles.append([i])
                else:
                    by_group.setdefault(k, []).append(i)
            return [by_group[k] for k in sorted(by_group)] + singles
        if self.num_groups is None:  # buckets in backprop's order (api/buckets.py)
            if not graph:
                return [dense] if dense else []
            sizes = [slot_nbytes(grads[i], variables[i] if variables is not None else None)
                     for i in dense]
            return [[dense[j] for j in bucket] for bucket in buckets.plan_for(sizes, self.process_set)]
        if self.num_groups:
            n = min(self.num_groups, len(dense)) or 1
            size, extra = divmod(len(dense), n)
            out, start = [], 0
            for k in range(n):
                stop = start + size + (1 if k < extra else 0)
                if stop > start:
                    out.append(dense[start:stop])
                start = stop
            return out
        return [[i] for i in dense]

    def __call__(self, grads: Sequence, variables: Optional[Sequence] = None) -> List:
        """The reduced gradients; None stays None, local ones stay on this rank (see register_local)."""
        grads = list(grads)
        if not reduces_here(self.process_set):
            return grads
        n = len(grads)
        local = self._is_local(variables, n)
        out = list(grads)
        self._scale_local(out, local)
        labels = [variable_name(variables[i] if variables is not None else None, i) for i in range(n)]
        if self.sparse_as_dense:
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        graph = not tf.executing_eagerly()
        base = graph_unique_name(self.name) if graph else self.name
        op, pre, post = self.op, self.prescale, self.postscale
        ps = self.process_set

        sparse = [i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices) and not local[i]]
        dense = [i for i, g in enumerate(grads)
                 if g is not None and not local[i] and not isinstance(g, tf.IndexedSlices)]
        if sparse and op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
            raise NotImplementedError(f"{self.name}: gradients of {[labels[i] for i in sparse]} are tf.IndexedSlices, "
                             f"which support only Average and Sum, not {op.name}; "
                             "pass sparse_as_dense=True")
        buckets_here = self.num_groups is None and self.groups is None
        if buckets_here:
            # Every position in the plan, None and IndexedSlices gradients too (sent as
            # empty stand-ins, bucket_slots.py): the buckets, their names and members are
            # then the same on every rank, and a gradient that is None or sparse on some
            # ranks only is a mismatch named at once, not a request the others never send.
            dense = [i for i in range(n) if not local[i]]
        groups = self._group_indices(dense, variables, grads, graph)
        # A sparse gradient's rows go once its bucket is back whole (every rank then has
        # rows there): where the bucket fails, no rank sends them.
        bucket_of = {i: b for b, members in enumerate(groups) for i in members
                     if isinstance(grads[i], tf.IndexedSlices)} if buckets_here else {}
        gate_handles = {}  # bucket -> its latest handle, where a sparse gradient waits for it
        jobs = []  # (order key, enqueue thunk, its tensors, the bucket it goes after, its bucket)
        # A graph's step of several requests: if it fails here after some left, the next
        # run tells the other ranks the rest will never come (api/buckets.BucketRuns).
        runs = buckets.BucketRuns([], ps) if graph and len(groups) + len(sparse) > 1 else None

        run_index = {}  # bucket -> its request's index in `runs`

        def tracked(name, submit, bucket=None, after=None):
            if runs is None:
                if after is None:
                    return submit
                return lambda *arrays: buckets.after(gate_handles[after], submit, *arrays)
            k = runs.add(name, across_traces(name), None if after is None else run_index[after])
            if bucket is not None:
                run_index[bucket] = k

            def submit_in_run(*arrays):
                return runs.submit(k, submit, *arrays)
            return submit_in_run

        def stand_in(i):
            """What position i sends where its gradient is not a dense tensor."""
            var = variables[i] if variables is not None else None
            return sparse_marker(var) if isinstance(grads[i], tf.IndexedSlices) else placeholder(var)

        def request(members, bucket=None):
            """(the compressed tensors and their contexts, submit, whether submit must get copies)"""
            # A stand-in is compressed as the gradient would be, so a bucket holds the same
            # dtypes on every rank (else it packs on one and not on another, under other
            # names, and every rank waits).
            comp = [(self.compression.compress(stand_in(i))[0], None)
                    if grads[i] is None or isinstance(grads[i], tf.IndexedSlices)
                    else self.compression.compress(tf.convert_to_tensor(grads[i]))
                    for i in members]
            if len(members) == 1:
                nm = f"{base}.grad.{labels[members[0]]}"
                submit, copy = (lambda a: _core.allreduce_async(a, op, nm, pre, post,
                                                                process_set=ps)), True
            else:
                nm = f"{base}.group.{labels[members[0]]}"
                submit, copy = grouped_allreduce_submit(nm, op, pre, post, ps)
            submit = tracked(nm, _naming(submit, [labels[i] for i in members]), bucket)
            if bucket is not None and bucket in bucket_of.values():
                submit = _recording(submit, gate_handles, bucket)
            return comp, submit, copy

        placeholders = []  # what stand-ins got back: nothing reads it but the barrier

        def decompress(members, comp, results):
            for i, r, (_, ctx) in zip(members, results, comp):
                if grads[i] is None or isinstance(grads[i], tf.IndexedSlices):
                    placeholders.append(r)
                else:
                    out[i] = self.compression.decompress(r, ctx)

        if graph and len(groups) == 1 and not sparse:
            # The step's only request (the default: one group): nothing else to enqueue,
            # so submitting and waiting can be one op.
            comp, submit, copy = request(groups[0])
            tensors = [c for c, _ in comp]
            decompress(groups[0], comp, run_alone(submit, tensors, [t.dtype for t in tensors],
                                                  [t.shape for t in tensors], copy))
            return out

        for b, members in enumerate(groups):
            def job(members=members, b=b):
                comp, submit, copy = request(members, b)
                tensors = [c for c, _ in comp]
                hid = _enqueue(submit, tensors, copy)

                def finish(hid):
                    decompress(members, comp, wait(hid, [t.dtype for t in tensors],
                                                   [t.shape for t in tensors]))
                return hid, finish
            jobs.append((max(members), job, [grads[i] for i in members if grads[i] is not None
                                             and not isinstance(grads[i], tf.IndexedSlices)],
                         None, b))

        for i in sparse:
            def job(i=i):
                g = grads[i]
                nm = f"{base}.grad.{labels[i]}"
                gate = bucket_of.get(i)
                hv = _enqueue(tracked(nm + ".values", lambda a, nm=nm: _core.allgather_async(
                    a, nm + ".values", ps), after=gate), [g.values])
                hi = _enqueue(tracked(nm + ".indices", lambda a, nm=nm: _core.allgather_async(
                    a, nm + ".indices", ps), after=gate), [g.indices])

                def finish(_):
                    values = wait(hv, [g.values.dtype], [tf.TensorShape([None]).concatenate(g.values.shape[1:])])[0]
                    indices = wait(hi, [g.indices.dtype], [[None]])[0]
                    if pre * post != 1.0:
                        values = values * tf.cast(pre * post, values.dtype)
                    if op == ReduceOp.AVERAGE:  # (the set's size when the step runs)
                        values = values / tf.cast(world_values.set_size(ps), values.dtype)
                    out[i] = tf.IndexedSlices(values, indices, dense_shape=g.dense_shape)
                return [hv, hi], finish
            jobs.append((i, job, [grads[i].values, grads[i].indices], bucket_of.get(i), None))

        # Enqueue in reverse list order (backprop's order), then wait for all. In a graph,
        # the rest of backprop waits for each enqueue, so each bucket leaves as soon as
        # its gradients exist (bucket_order.py).
        # (A bucket before the sparse gradients it holds: the sort is stable.)
        jobs.sort(key=lambda j: -j[0])
        order = BucketOrder(tf.compat.v1.get_default_graph()) if graph and len(jobs) > 1 else None
        started, enqueue_of = [], {}  # bucket -> its enqueue op
        for _, job, tensors, gate, bucket in jobs:
            if order is not None:
                order.order_after(tensors)
            # A sparse gradient's rows are submitted after its bucket (they go after it).
            with tf.control_dependencies([enqueue_of[gate]] if graph and gate is not None else None):
                started.append(job())
            if bucket is not None and graph:
                enqueue_of[bucket] = started[-1][0].op
            if order is not None:
                hid = started[-1][0]
                for h in (hid if isinstance(hid, list) else [hid]):
                    order.enqueued(h.op)
        if graph:
            hids = []
            for hid, _ in started:
                hids.extend(hid if isinstance(hid, list) else [hid])
            with tf.control_dependencies(after_all(hids)):
                for hid, finish in started:
                    finish(hid)
            _after_every_request(out, [i for i, g in enumerate(grads)
                                       if g is not None and not local[i]], placeholders)
        else:
            error = None
            for hid, finish in started:  # every request waited for: none left in flight
                try:
                    finish(hid)
                except tf.errors.OpError as e:
                    error = error or e
            if error is not None:
                raise error
        return out


def _naming(submit, member_labels):
    """`submit`, whose handle's mismatch of member shapes names the variables that differ."""
    return lambda *arrays: naming_members(submit(*arrays), member_labels)


def _recording(submit, handles: dict, bucket: int):
    """`submit`, keeping its latest handle as handles[bucket] (what sparse rows go after)."""
    def submit_recorded(*arrays):
        handles[bucket] = submit(*arrays)
        return handles[bucket]
    return submit_recorded


def _after_every_request(out: List, reduced: List[int], placeholders: List) -> None:
    """Every reduced gradient of a graph step of several requests waits for all of them:
    an update made from the gradients then runs on every rank or on none (a step that
    fails on one rank after some buckets left fails the others at a later bucket, and
    without this they would have applied the buckets before it). The stand-ins' waits
    are among them through one assert that reads them all (a wait whose output only a
    control input needs is pruned, and its error with it; one assert per stand-in was
    1000 stateful ops a step where 1000 variables had no gradient)."""
    done = [tf.debugging.assert_equal(tf.add_n([tf.size(r) for r in placeholders]), 0,
                                      message="None or sparse gradients' stand-ins")
            ] if placeholders else []
    for i in reduced:
        g = out[i]
        done.extend([g.values, g.indices] if isinstance(g, tf.IndexedSlices) else [g])
    if len(done) <= 1:
        return
    with tf.control_dependencies(after_all(done)):
        for i in reduced:
            g = out[i]
            out[i] = (tf.IndexedSlices(tf.identity(g.values), tf.identity(g.indices), g.dense_shape)
                      if isinstance(g, tf.IndexedSlices) else tf.identity(g))
    # A Keras optimizer given these runs all of its update after them, the parts that
    # need no gradient too (iterations, weight decay): update_barrier.py.
    update_barrier.mark([out[i].values if isinstance(out[i], tf.IndexedSlices) else out[i]
                         for i in reduced])
    update_barrier.install()
