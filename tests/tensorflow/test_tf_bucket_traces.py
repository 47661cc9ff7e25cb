"""Rank side: gradient buckets across the traces of one function, and what tracing costs.

Buckets are on in every run of this file (HOROLITE_GRADIENT_BUCKET_MB=0.3 unless the
driver set a cap). A tf.function traces once per input shape, and each trace holds its
own copy of the step's buckets under the same request names: a step that failed on one
rank in one trace must be noticed by the next step whichever trace it runs, or its
buckets pair with the other ranks' failed step and the weights silently differ. A step
traced inside another function (Keras fit's) is numbered apart in each trace: there the
ranks waited for ever.
The barrier that keeps the weights equal after a failed step must cost edges linear in
the number of variables, not one per (op, gradient) pair.
"""
import faulthandler
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("HOROLITE_GRADIENT_BUCKET_MB", "0.3")

import keras
import numpy as np
import pytest
import tensorflow as tf
from horolite.core.mpi_library import MPI  # the job world's: mpi4py's under mpirun

import horolite.tensorflow as hvd
import horolite.tensorflow.keras as hvd_keras
from horolite.api import buckets as bucket_plan
from bucket_failures import (WIDTH, batch, fail_if_hung, fail_on_rank_1, failing_model,
                             same_on_every_rank)

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
hvd.init()
COMM = MPI.COMM_WORLD
R, N = hvd.rank(), hvd.size()


def _two_ranks():
    if N < 2:
        pytest.skip("needs at least two ranks")


def requests_per_step(variables) -> int:
    return len(bucket_plan.plan([int(np.prod(v.shape)) * 4 for v in variables],
                                bucket_plan.bucket_cap_bytes()))


def _tape_step(model, opt):
    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = keras.losses.MeanSquaredError()(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    return step


def tape_runner(model, opt):
    step = _tape_step(model, opt)
    return lambda rows: step(*batch(R, rows))


def test_a_step_failed_in_one_trace_fails_the_others_when_rank_1_runs_another_trace():
    # Two batch shapes: two traces of one function, the same request names. Rank 1 fails
    # in the first (after its top bucket left), then every rank runs the second: rank 1's
    # first bucket there tells the others its failed step's other buckets never come, so
    # their step fails naming rank 1 (before, rank 1's new buckets completed the others'
    # failed step), and no rank applied any of it.
    _two_ranks()
    flag = tf.Variable(0.0, trainable=False)
    model = failing_model(flag)
    assert requests_per_step(model.trainable_variables) >= 2, "needs several buckets"
    opt = hvd_keras.DistributedOptimizer(keras.optimizers.Adam(1e-3))
    run = tape_runner(model, opt)
    run(32)
    run(48)  # both traces made and warm
    fail_on_rank_1(flag, run, 32)
    flag.assign(0.0)
    run(48)
    run(32)
    same_on_every_rank([v.numpy() for v in model.trainable_variables], "weight")
    same_on_every_rank([v.numpy() for v in opt.variables], "optimizer variable")
    assert int(opt.iterations.numpy()) == 4  # the failed step counted nowhere


def fit_runner(model, opt):
    model.compile(optimizer=opt, loss=keras.losses.MeanSquaredError())

    def run(rows):
        model.fit(*batch(R, rows), batch_size=rows, epochs=1, shuffle=False, verbose=0)
    return run


def nested_tape_runner(model, opt):
    # A step traced inside another function, as fit's is: its first trace creates the
    # optimizer's variables, so tf.function traces it twice inside the outer graph.
    inner = _tape_step(model, opt)

    @tf.function
    def outer(x, y):
        inner(x, y)
    return lambda rows: outer(*batch(R, rows))


def reference(steps):
    """Plain Keras, no horolite: the weights after one Adam step per batch size in
    `steps`, each on the gradient averaged over every rank's batch of that size."""
    model = failing_model(tf.Variable(0.0, trainable=False))
    opt = keras.optimizers.Adam(1e-3)
    for rows in steps:
        per_rank = []
        for r in range(N):
            x, y = batch(r, rows)
            with tf.GradientTape() as tape:
                loss = keras.losses.MeanSquaredError()(y, model(x, training=True))
            per_rank.append(tape.gradient(loss, model.trainable_variables))
        opt.apply_gradients(zip([tf.add_n(list(g)) / N for g in zip(*per_rank)],
                                model.trainable_variables))
    return [v.numpy() for v in model.trainable_variables]


@pytest.mark.parametrize("how", ["fit", "fit_recompiled", "nested_tape"])
def test_a_step_failed_in_one_trace_of_a_nested_step_fails_the_others_then_trains_on(how):
    # fit's step is a tf.function inside another; its first trace is made twice in the
    # outer graph (the first made the optimizer's variables), so its requests carry
    # another scope than any later trace's (one_step_on_data_1, one_step_on_data). Rank 1
    # fails in the first trace; then every rank runs another (another batch shape, or a
    # new train function after compile): before, the others waited for ever for the
    # failed step's buckets. Now they fail naming rank 1, and training goes on exactly as
    # plain Keras would without the failed step.
    _two_ranks()
    log = fail_if_hung(150)
    try:
        flag = tf.Variable(0.0, trainable=False)
        model = failing_model(flag)
        opt = hvd_keras.DistributedOptimizer(keras.optimizers.Adam(1e-3))
        run = (nested_tape_runner if how == "nested_tape" else fit_runner)(model, opt)
        run(32)
        if how != "fit_recompiled":
            run(48)  # both traces made and warm
        fail_on_rank_1(flag, run, 32)
        if how == "fit_recompiled":  # a new train function: every trace of it is new
            model.compile(optimizer=opt, loss=keras.losses.MeanSquaredError())
        flag.assign(0.0)
        run(48)
        run(32)
    finally:
        faulthandler.cancel_dump_traceback_later()
        if log is not None:
            log.close()
    steps = [32, 48, 48, 32] if how != "fit_recompiled" else [32, 48, 32]
    weights = [v.numpy() for v in model.trainable_variables]
    same_on_every_rank(weights, "weight")
    same_on_every_rank([v.numpy() for v in opt.variables], "optimizer variable")
    assert int(opt.iterations.numpy()) == len(steps)  # the failed step counted nowhere
    for k, (got, want) in enumerate(zip(weights, reference(steps))):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"weight {k}")


# ---- what the barrier costs in the traced graph ----

def control_edges(graph_def):
    """(control inputs, nodes) in `graph_def` and the functions it holds."""
    nodes = [n for ns in [graph_def.node] + [f.node_def for f in graph_def.library.function]
             for n in ns]
    return sum(1 for n in nodes for i in n.input if i.startswith("^")), len(nodes)


def wide_model(layers):
    keras.utils.set_random_seed(9)
    return keras.Sequential([keras.Input((16,))] +
                            [keras.layers.Dense(16, activation="tanh") for _ in range(layers)])


@pytest.mark.parametrize("compression", ["none", "fp16"])
def test_the_update_waits_for_every_request_through_edges_linear_in_the_graph(compression):
    # One request per gradient: before, every root op of Adam's update took one control
    # input per gradient, every wait one per enqueue, and with fp16 every reduced gradient
    # one per cast (N^2 each: tens of thousands of edges here, 1.35 M at 300 variables).
    # TensorFlow's own ordering gives about one per op.
    _two_ranks()
    model = wide_model(30)
    n = len(model.trainable_variables)
    opt = hvd_keras.DistributedOptimizer(keras.optimizers.Adam(1e-3), num_groups=n,
                                         compression=getattr(hvd.Compression, compression))
    model.compile(optimizer=opt, loss=keras.losses.MeanSquaredError())
    rng = np.random.RandomState(R)
    x, y = rng.normal(size=(8, 16)).astype(np.float32), rng.normal(size=(8, 16)).astype(np.float32)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    graph_def = _functions(model.train_function)[-1].graph.as_graph_def()
    edges, ops = control_edges(graph_def)
    assert edges < 2 * ops, f"{edges} control edges among {ops} ops ({n} variables)"


def _functions(fn):
    fns = [c.cell_contents for c in (fn.__closure__ or ())] if not hasattr(
        fn, "_list_all_concrete_functions") else [fn]
    for f in fns:
        if hasattr(f, "_list_all_concrete_functions"):
            return f._list_all_concrete_functions()
    raise AssertionError(f"no traced function in {fn}")


# ---- a gradient None on one rank only, with fp16 compression ----

def test_a_gradient_none_on_one_rank_only_with_fp16_fails_every_rank_at_once():
    # Rank 1's trace skips a middle layer: its gradients there are None. Its placeholder
    # travelled as float32 beside float16 gradients, so that bucket went unpacked on rank 1
    # and packed on the others, under other names, and every rank waited for ever; now
    # every rank gets the mismatch at once, and the next step works.
    _two_ranks()
    keras.utils.set_random_seed(17)
    layers = [keras.layers.Dense(WIDTH, activation="tanh") for _ in range(5)] + [keras.layers.Dense(4)]
    model = keras.Sequential([keras.Input((WIDTH,))] + layers)
    x = batch(R, 16)[0]

    def step(skip):
        with tf.GradientTape() as tape:
            h = x
            for k, layer in enumerate(layers):
                if not (skip and k == 2):
                    h = layer(h)
            loss = tf.reduce_mean(h)
        tape = hvd.DistributedGradientTape(tape, compression=hvd.Compression.fp16)
        return tape.gradient(loss, model.trainable_variables)
    started = time.monotonic()
    with pytest.raises(tf.errors.OpError, match=r"mismatched .*shapes?: ranks? 0(, \d+)* had .*rank 1 had"):
        tf.function(step)(R == 1)
    assert time.monotonic() - started < 60
    got = tf.function(step)(False)
    assert all(g is not None and g.dtype == tf.float32 for g in got)

