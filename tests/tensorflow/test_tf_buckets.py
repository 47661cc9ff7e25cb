"""Rank side: a step's gradients leave in buckets while backprop runs.

The driver (tests/test_matrix_tensorflow.py, and the simulated hosts) says whether
buckets are expected in this run (HOROLITE_TEST_EXPECT_BUCKETS: HOROLITE_GRADIENT_BUCKET_MB
set, or ranks on several hosts) or one request per step (one host, the default).
Values are checked against NumPy references from each rank's known inputs (local
gradients exchanged with mpi4py, never with horolite), what travelled against the
runtime's own timeline: how many requests each step made, and when each bucket was
handed over (its enqueue op ran) and exchanged.
"""
import os
import re
import tempfile
import uuid

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np
import pytest
import tensorflow as tf
from horolite.core.mpi_library import MPI  # the job world's: mpi4py's under mpirun

import horolite.tensorflow as hvd
import horolite.tensorflow.keras as hvd_keras
from horolite.api import buckets as bucket_plan
from horolite.core.timeline import read_events
from tf_modes import NATIVE
from bucket_failures import PEER_FAILED, FailOnFlag, same_on_every_rank

# One thread each, as a rank on a busy host runs (and the case where TensorFlow's executor,
# left alone, ran every bucket's enqueue at the end of backprop).
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
_n = int(os.environ.get("HOROLITE_SIZE") or MPI.COMM_WORLD.Get_size())  # (gloo: before init)
PAIR = hvd.ProcessSet([0, 1]) if _n > 2 else None  # a set smaller than the job
hvd.init(process_sets=[PAIR] if PAIR is not None else None)
COMM = MPI.COMM_WORLD
R, N = hvd.rank(), hvd.size()
EXPECT = os.environ.get("HOROLITE_TEST_EXPECT_BUCKETS", "0") == "1"
CAP = bucket_plan.bucket_cap_bytes()
FLOATS = [tf.float16, tf.bfloat16, tf.float32, tf.float64]
SHAPES = [(96, 256), (256,), (256, 256), (256,), (256, 64), (64,), (64, 10), (10,)]
_TMP = tempfile.mkdtemp(prefix=f"hl-buckets-r{R}-")


def test_the_run_has_the_bucketing_the_driver_expects():
    assert (CAP > 0) == EXPECT, f"bucket cap {CAP} bytes, driver expects buckets: {EXPECT}"


def inputs(r, dtype, seed=0):
    """Rank r's X_k: the gradient of sum_k sum(V_k * X_k) with respect to V_k."""
    rng = np.random.RandomState(100 * seed + r)
    return [rng.uniform(-1, 1, size=s).astype(np.float64) for s in SHAPES]


def mean_over(ranks, dtype, seed=0):
    """NumPy: the average of every rank's X_k, each first rounded to the dtype as TF holds it."""
    np_dtype = dtype.as_numpy_dtype
    per_rank = [[x.astype(np_dtype).astype(np.float64) for x in inputs(r, dtype, seed)]
                for r in ranks]
    return [np.mean([p[k] for p in per_rank], axis=0) for k in range(len(SHAPES))]


def recorded(fn):
    """(fn's result, the timeline events the runtime wrote while fn ran)."""
    path = os.path.join(_TMP, f"{uuid.uuid4().hex}.json")
    hvd.start_timeline(path)
    try:
        out = fn()
    finally:
        hvd.stop_timeline()
    actual = path if R == 0 else path[:-5] + f".rank{R}.json"
    return out, read_events(actual)


def requests(events, marker):
    """Names of the requests (rows) the runtime negotiated or reduced (a small one may ride
    in the control round: no NEGOTIATE span, an ALLREDUCE one), for `marker`."""
    rows = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    return {rows[e["tid"]] for e in events
            if e.get("name") in ("NEGOTIATE", "ALLREDUCE") and marker in rows[e["tid"]]}


def expected_requests(dtype, sizes=None, cap=CAP):
    sizes = sizes or [int(np.prod(s)) * dtype.size for s in SHAPES]
    return len(bucket_plan.plan(sizes, cap)) if cap else 1


def tolerance(dtype):
    return {tf.float16: 2e-3, tf.bfloat16: 2e-2}.get(dtype, 1e-6)


# ---- the tape, every float dtype ----

def tape_gradients(dtype, seed=0, **kwargs):
    variables = [tf.Variable(tf.zeros(s, dtype)) for s in SHAPES]
    xs = [tf.constant(x, dtype) for x in inputs(R, dtype, seed)]

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(tf.cast(v * x, tf.float32)) for v, x in zip(variables, xs)])
        tape = hvd.DistributedGradientTape(tape, **kwargs)
        return tape.gradient(loss, variables)
    step()  # trace and warm the cache
    return step


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
def test_tape_buckets_average_like_numpy_and_like_one_group(dtype):
    step = tape_gradients(dtype)
    got, events = recorded(lambda: [g.numpy().astype(np.float64) for g in step()])
    for g, want in zip(got, mean_over(range(N), dtype)):
        np.testing.assert_allclose(g, want, rtol=tolerance(dtype), atol=tolerance(dtype))
    assert len(requests(events, "DistributedGradientTape")) == expected_requests(dtype)
    one = [g.numpy() for g in tape_gradients(dtype, num_groups=1)()]
    for g, o in zip(got, one):
        if N <= 2:  # the same sum of the same two values: the same bits
            np.testing.assert_array_equal(g, o.astype(np.float64))
        else:
            np.testing.assert_allclose(g, o.astype(np.float64), rtol=tolerance(dtype),
                                       atol=tolerance(dtype))


def linear_loss(variables, xs):
    """sum_k sum(V_k * X_k): its gradient with respect to V_k is X_k."""
    return tf.add_n([tf.reduce_sum(tf.cast(v * x, tf.float32)) for v, x in zip(variables, xs)])


def keras_optimizer_step(dtype, seed, **kwargs):
    """(the variables after one DistributedOptimizer SGD(1.0) step from zeros, the timeline)."""
    variables = [tf.Variable(tf.zeros(s, dtype)) for s in SHAPES]
    xs = [tf.constant(x, dtype) for x in inputs(R, dtype, seed)]
    opt = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(1.0), **kwargs)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = linear_loss(variables, xs)
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
    _, events = recorded(step)
    return [v.numpy().astype(np.float64) for v in variables], events


def legacy_optimizer_step(dtype, seed, **kwargs):
    """The same with the legacy optimizer in a TF1 graph."""
    with tf.Graph().as_default():
        variables = [tf.compat.v1.Variable(tf.zeros(s, dtype)) for s in SHAPES]
        xs = [tf.constant(x, dtype) for x in inputs(R, dtype, seed)]
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0), **kwargs)
        train = opt.minimize(linear_loss(variables, xs), var_list=variables)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            _, events = recorded(lambda: sess.run(train))
            got = sess.run(variables)
    return [np.asarray(g).astype(np.float64) for g in got], events


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
@pytest.mark.parametrize("which", ["keras", "legacy"])
def test_optimizer_buckets_every_float_dtype_like_numpy_and_like_one_group(which, dtype):
    # SGD(1.0) from zeros: the variables end at minus the average of every rank's X_k.
    run, marker = {"keras": (keras_optimizer_step, "DistributedSGD"),
                   "legacy": (legacy_optimizer_step, "DistributedGradientDescent")}[which]
    got, events = run(dtype, 3)
    for g, want in zip(got, mean_over(range(N), dtype, 3)):
        np.testing.assert_allclose(g, -want, rtol=tolerance(dtype), atol=tolerance(dtype))
    assert len(requests(events, marker)) == expected_requests(dtype)
    one, _ = run(dtype, 3, num_groups=1)
    for g, o in zip(got, one):
        if N <= 2:  # the same sum of the same two values: the same bits
            np.testing.assert_array_equal(g, o)
        else:
            np.testing.assert_allclose(g, o, rtol=tolerance(dtype), atol=tolerance(dtype))


def test_explicit_num_groups_keeps_horovods_meaning():
    step = tape_gradients(tf.float32, num_groups=3)
    got, events = recorded(lambda: [g.numpy() for g in step()])
    assert len(requests(events, "DistributedGradientTape")) == 3
    for g, want in zip(got, mean_over(range(N), tf.float32)):
        np.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-6)


def test_buckets_go_only_on_the_step_that_exchanges():
    variables = [tf.Variable(tf.zeros(s, tf.float32)) for s in SHAPES]
    batches = [[tf.constant(x, tf.float32) for x in inputs(R, tf.float32, seed)] for seed in (1, 2)]
    tape_kwargs = dict(backward_passes_per_step=2)

    @tf.function
    def step(xs):
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * x) for v, x in zip(variables, xs)])
        return hvd.DistributedGradientTape(tape, **tape_kwargs).gradient(loss, variables)

    first, ev1 = recorded(lambda: [g.numpy() for g in step(batches[0])])
    second, ev2 = recorded(lambda: [g.numpy() for g in step(batches[1])])
    assert requests(ev1, "DistributedGradientTape") == set()
    assert len(requests(ev2, "DistributedGradientTape")) == expected_requests(tf.float32)
    want = [a + b for a, b in zip(mean_over(range(N), tf.float32, 1), mean_over(range(N), tf.float32, 2))]
    for g, w in zip(second, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    assert all(not np.any(g) for g in first)


def test_sparse_gradients_travel_beside_the_buckets():
    table = tf.Variable(tf.zeros((20, 8)))
    dense = [tf.Variable(tf.zeros(s)) for s in SHAPES]
    ids = tf.constant([R % 20, (3 * R + 1) % 20, 7])
    xs = [tf.constant(x, tf.float32) for x in inputs(R, tf.float32)]

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(table, ids)) + \
                tf.add_n([tf.reduce_sum(v * x) for v, x in zip(dense, xs)])
        return hvd.DistributedGradientTape(tape).gradient(loss, [table] + dense)

    got = step()
    assert isinstance(got[0], tf.IndexedSlices)
    rows = np.zeros((20, 8))
    for r in range(N):
        for i in (r % 20, (3 * r + 1) % 20, 7):
            rows[i] += 1.0 / N
    np.testing.assert_allclose(tf.convert_to_tensor(got[0]).numpy(), rows, rtol=1e-6)
    for g, want in zip(got[1:], mean_over(range(N), tf.float32)):
        np.testing.assert_allclose(g.numpy(), want, rtol=1e-6, atol=1e-6)


def test_a_process_set_reduces_its_own_ranks_in_buckets():
    if PAIR is None:
        pytest.skip("a subset of two ranks needs a third outside it")
    step = tape_gradients(tf.float32, process_set=PAIR)
    got, events = recorded(lambda: [g.numpy() for g in step()])
    if R in (0, 1):
        want = mean_over([0, 1], tf.float32)
        assert len(requests(events, "DistributedGradientTape")) == expected_requests(
            tf.float32, cap=bucket_plan.bucket_cap_bytes(PAIR))
    else:  # outside the set the gradients stay this rank's own
        want = [x.astype(np.float32) for x in inputs(R, tf.float32)]
        assert requests(events, "DistributedGradientTape") == set()
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


# ---- a real model: fit, the legacy optimizer in a TF1 graph, and the overlap ----

LAYERS, WIDTH, BATCH = 12, 256, 512


def mlp(seed=3):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((WIDTH,))] +
                            [keras.layers.Dense(WIDTH, activation="tanh") for _ in range(LAYERS)] +
                            [keras.layers.Dense(4)])


def data(r):
    rng = np.random.RandomState(7 + r)
    return rng.normal(size=(BATCH, WIDTH)).astype(np.float32), rng.normal(size=(BATCH, 4)).astype(np.float32)


def reference_update(model, lr):
    """NumPy: the weights after one SGD step on every rank's batch averaged: each rank's
    local gradients (plain TensorFlow, no horolite) gathered with mpi4py."""
    x, y = data(R)
    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(y, model(x, training=True))
    local = [g.numpy().astype(np.float64) for g in tape.gradient(loss, model.trainable_variables)]
    every = COMM.allgather(local)
    return [v.numpy() - lr * np.mean([e[k] for e in every], axis=0)
            for k, v in enumerate(model.trainable_variables)]


def tape_step(model, opt=None):
    """A tf.function step of `model` (SGD unless `opt`) on this rank's data with
    DistributedGradientTape."""
    opt = opt or keras.optimizers.SGD(0.01)
    x, y = (tf.constant(a) for a in data(R))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = keras.losses.MeanSquaredError()(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
        return loss
    return step


def bucket_enqueues_waited_for(graph_def, tf1=False) -> int:
    """How many enqueue ops some op of backprop (not TensorFlow's own ordering: an enqueue,
    a NoOp, a call, in a tf.function an Identity, which it makes of what it returns) has
    a control input on, in `graph_def` and every function it holds: bucket_order.py's
    edges, which make a bucket leave before the layers below it are computed (in TF1
    graphs the first op of a gradient is often tf.gradients' own Identity)."""
    ignored = {"HorolitEnqueue", "HorolitAsyncWait", "NoOp", "StatefulPartitionedCall",
               "PartitionedCall"} | (set() if tf1 else {"Identity"})
    found = set()
    for nodes in [graph_def.node] + [f.node_def for f in graph_def.library.function]:
        enqueues = {n.name for n in nodes if n.op == "HorolitEnqueue"}
        for n in nodes:
            if n.op not in ignored:
                found.update((id(nodes), i[1:]) for i in n.input
                             if i.startswith("^") and i[1:] in enqueues)
    return len(found)


def traced(fn):
    """The graph_def of a tf.function's concrete functions (Keras' train_function included)."""
    fns = [c.cell_contents for c in (fn.__closure__ or ())] if not hasattr(
        fn, "_list_all_concrete_functions") else [fn]
    for f in fns:
        if hasattr(f, "_list_all_concrete_functions"):
            return f._list_all_concrete_functions()[-1].graph.as_graph_def()
    raise AssertionError(f"no traced function in {fn}")


def enqueue_spread(events, marker) -> float:
    """The median over steps (all ranks) of the time from a step's first bucket's enqueue
    to its last, as a share of the time between steps: about backprop's share of the step
    when each bucket leaves as backprop makes it, near 0 when every enqueue waits for the
    end of backprop (measured 0.41-0.53 against 0.00-0.21 with bucket_order's edges off,
    docs/tensorflow.md)."""
    rows = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    times = sorted(e["ts"] for e in events
                   if e.get("name") == "ENQUEUE" and marker in rows[e["tid"]])
    per_step = len({rows[e["tid"]] for e in events
                    if e.get("name") == "ENQUEUE" and marker in rows[e["tid"]]})
    steps = [times[i:i + per_step] for i in range(0, len(times), per_step)]
    shares = [(s[-1] - s[0]) / (nxt[0] - s[0]) for s, nxt in zip(steps, steps[1:])]
    return float(np.median(sum(COMM.allgather(shares), [])))


# Well below what the edges give (0.41-0.53 with 12 buckets, 0.22 for fit's 2 buckets of
# 2 MiB on pretend hosts), well above the median without them (0.00-0.03).
SPREAD = 0.1


def negotiated_afresh(events, marker) -> int:
    """NEGOTIATE spans of `marker`'s requests that did not hit the response cache."""
    rows = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    return sum(1 for e in events if e.get("name") == "NEGOTIATE" and marker in rows[e["tid"]]
               and not e.get("args", {}).get("cached"))


def _overlap_needs():
    if N < 2:
        pytest.skip("needs at least two ranks")
    if not NATIVE:
        pytest.skip("HOROLITE_TF_NATIVE_OPS=0 in this run")


def test_fit_applies_the_averaged_gradients_and_overlaps():
    _overlap_needs()
    model = mlp()
    want = reference_update(mlp(), 0.05)
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.05)),
                  loss=keras.losses.MeanSquaredError())
    x, y = data(R)
    _, events = recorded(lambda: model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0))
    for v, w in zip(model.trainable_variables, want):
        np.testing.assert_allclose(v.numpy(), w, rtol=2e-4, atol=2e-5)
    assert len(requests(events, "DistributedSGD")) == expected_requests(
        tf.float32, [int(np.prod(v.shape)) * 4 for v in model.trainable_variables])
    if EXPECT:  # later steps: the buckets are cached, the overlap shows
        # Steps after the first start together (the previous one's exchange ends them).
        ds = tf.data.Dataset.from_tensors((x, y)).repeat()
        _, events = recorded(lambda: model.fit(ds, steps_per_epoch=6, shuffle=False, verbose=0))
        n = expected_requests(tf.float32, [int(np.prod(v.shape)) * 4 for v in model.trainable_variables])
        assert bucket_enqueues_waited_for(traced(model.train_function)) == n - 1
        assert enqueue_spread(events, "DistributedSGD") > SPREAD, "the buckets left together"
        assert negotiated_afresh(events, "DistributedSGD") == 0


def test_tape_in_a_function_overlaps():
    _overlap_needs()
    assert EXPECT, "the driver runs this case only where buckets are expected"
    model = mlp()
    step = tape_step(model)
    step()
    _, events = recorded(lambda: [step().numpy() for _ in range(6)])
    # Every bucket but the last holds back the rest of backprop (bucket_order.py), so it
    # leaves as backprop makes it; the steps after the first hit the response cache.
    n = expected_requests(tf.float32, [int(np.prod(v.shape)) * 4 for v in model.trainable_variables])
    assert bucket_enqueues_waited_for(traced(step)) == n - 1
    assert enqueue_spread(events, "DistributedGradientTape") > SPREAD, "the buckets left together"
    assert negotiated_afresh(events, "DistributedGradientTape") == 0


def test_legacy_optimizer_in_a_tf1_graph_updates_like_numpy_and_overlaps():
    _overlap_needs()
    model = mlp()
    want = reference_update(mlp(), 0.05)
    weights = [v.numpy() for v in model.trainable_variables]
    x, y = data(R)
    with tf.Graph().as_default():
        variables = [tf.compat.v1.Variable(w) for w in weights]
        h = tf.constant(x)
        for k in range(0, len(variables) - 2, 2):
            h = tf.tanh(h @ variables[k] + variables[k + 1])
        out = h @ variables[-2] + variables[-1]
        loss = tf.reduce_mean(tf.square(out - y))
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.05))
        train = opt.minimize(loss, var_list=variables)
        # One inter-op thread, as in the tf.function cases (a session's default is a pool).
        config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=1,
                                          intra_op_parallelism_threads=1)
        with tf.compat.v1.Session(config=config) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            _, events = recorded(lambda: sess.run(train))
            got = sess.run(variables)
            if EXPECT:
                later = recorded(lambda: [sess.run(train) for _ in range(6)])[1]
                spread = enqueue_spread(later, "DistributedGradientDescent")
                waited_for = bucket_enqueues_waited_for(sess.graph.as_graph_def(), tf1=True)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-5)
    assert len(requests(events, "DistributedGradientDescent")) == expected_requests(
        tf.float32, [w.nbytes for w in weights])
    if EXPECT:
        assert spread > SPREAD, "the buckets left together"
        assert waited_for == expected_requests(tf.float32, [w.nbytes for w in weights]) - 1


def failing_model(flag):
    keras.utils.set_random_seed(5)
    return keras.Sequential([keras.Input((WIDTH,)), keras.layers.Dense(WIDTH, activation="tanh"),
                             FailOnFlag(flag)] +
                            [keras.layers.Dense(WIDTH, activation="tanh") for _ in range(LAYERS)] +
                            [keras.layers.Dense(4)])


def fail_on_rank_1(run, flag, times=1):
    """run() fails `times` times in a row on every rank (rank 1: its own op's error; the
    others: naming rank 1), then works everywhere."""
    for _ in range(times):
        flag.assign(1.0 if R == 1 else 0.0)
        if R == 1:
            with pytest.raises(tf.errors.InvalidArgumentError, match="reshape"):
                run()
        else:
            with pytest.raises(tf.errors.OpError, match=PEER_FAILED):
                run()
    flag.assign(0.0)
    run()


def test_a_rank_failing_after_its_first_bucket_left_fails_the_step_everywhere_then_works():
    # Twice in a row: the second run's notices wait behind the first's. No rank applies
    # any of a failed step: afterwards every weight and the optimizer's own variables
    # (iterations, momentum) are the same on every rank.
    if N < 2:
        pytest.skip("needs at least two ranks")
    flag = tf.Variable(0.0, trainable=False)
    model = failing_model(flag)
    opt = keras.optimizers.SGD(0.01, momentum=0.9)
    step = tape_step(model, opt)
    step()
    sizes = [int(np.prod(v.shape)) * 4 for v in model.trainable_variables]
    assert expected_requests(tf.float32, sizes) >= 2, "the driver runs this case with buckets"
    fail_on_rank_1(step, flag, times=2)
    step()
    same_on_every_rank([v.numpy() for v in model.trainable_variables], "weight")
    same_on_every_rank([v.numpy() for v in opt.variables], "optimizer variable")


def test_fit_failing_after_its_first_bucket_left_on_one_rank_changes_no_rank():
    if N < 2:
        pytest.skip("needs at least two ranks")
    flag = tf.Variable(0.0, trainable=False)
    model = failing_model(flag)
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9)),
                  loss=keras.losses.MeanSquaredError())
    x, y = data(R)

    def run():
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    run()
    fail_on_rank_1(run, flag)
    run()
    same_on_every_rank([v.numpy() for v in model.trainable_variables], "weight")
    same_on_every_rank([v.numpy() for v in model.optimizer.variables], "optimizer variable")
    assert int(model.optimizer.iterations.numpy()) == 3  # the failed step counted nowhere


def test_the_legacy_optimizer_failing_after_its_first_bucket_left_on_one_rank_changes_no_rank():
    if N < 2:
        pytest.skip("needs at least two ranks")
    x, y = data(R)
    with tf.Graph().as_default():
        flag = tf.compat.v1.Variable(0.0, trainable=False)
        # Deep enough that the first bucket (up to 1 MiB) leaves before the failing layer's
        # gradient, at every bucket cap the driver uses.
        shapes = [(WIDTH, WIDTH), (WIDTH,)] * LAYERS + [(WIDTH, 4), (4,)]
        assert expected_requests(tf.float32, [int(np.prod(s)) * 4 for s in shapes]) >= 2
        rng = np.random.RandomState(23)
        variables = [tf.compat.v1.Variable(rng.normal(0, 0.05, size=s).astype(np.float32))
                     for s in shapes]
        h = tf.constant(x)
        for k in range(0, len(variables) - 2, 2):
            h = tf.tanh(h @ variables[k] + variables[k + 1])
            if k == 0:
                h = FailOnFlag(flag)(h)
        loss = tf.reduce_mean(tf.square(h @ variables[-2] + variables[-1] - y))
        step = tf.compat.v1.train.get_or_create_global_step()
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.MomentumOptimizer(0.01, 0.9))
        train = opt.minimize(loss, var_list=variables, global_step=step)
        raise_flag, lower_flag = flag.assign(1.0 if R == 1 else 0.0), flag.assign(0.0)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(train)
            sess.run(raise_flag)
            if R == 1:
                with pytest.raises(tf.errors.InvalidArgumentError, match="reshape"):
                    sess.run(train)
            else:
                with pytest.raises(tf.errors.OpError, match=PEER_FAILED):
                    sess.run(train)
            sess.run(lower_flag)
            sess.run(train)
            sess.run(train)
            state = sess.run(tf.compat.v1.global_variables())
            assert sess.run(step) == 3  # the failed step counted nowhere
    same_on_every_rank(state, "variable (weights, momentum slots, global step)")


def test_zz_the_buckets_ran_on_the_exchange_lane_where_the_driver_expects_it():
    # (last in the file: after the steps above) Across (pretend) hosts the agreed buckets
    # run on the exchange lane's thread by default; on one host on the background thread.
    from horolite.runtime import registry
    rt = registry.current()
    expect = os.environ.get("HOROLITE_TEST_EXPECT_LANE", "0") == "1" and N > 1
    assert (rt.lane is not None) == expect, f"lane {rt.lane}, driver expects one: {expect}"
    if expect:
        assert rt.lane.lists > 0


# ---- a collective inside backprop (SyncBatchNormalization, hvd.allreduce with a gradient) ----

SBN_WIDTH, SBN_LAYERS, SBN_BATCH = 256, 6, 64


def sync_bn_model(norm, seed=11):
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((SBN_WIDTH,))]
    for _ in range(SBN_LAYERS):
        layers += [keras.layers.Dense(SBN_WIDTH), norm(), keras.layers.Activation("tanh")]
    return keras.Sequential(layers + [keras.layers.Dense(4)])


def sync_bn_data(r):
    rng = np.random.RandomState(40 + r)
    return (rng.normal(size=(SBN_BATCH, SBN_WIDTH)).astype(np.float32),
            rng.normal(size=(SBN_BATCH, 4)).astype(np.float32))


def sync_bn_reference(lr):
    """Plain TensorFlow, no horolite: BatchNormalization over every rank's rows at once
    (gathered with mpi4py), one SGD step on their mean squared error; with equal
    batches that is what SyncBatchNormalization and averaged gradients compute."""
    every = COMM.allgather(sync_bn_data(R))
    x = np.concatenate([e[0] for e in every])
    y = np.concatenate([e[1] for e in every])
    model = sync_bn_model(keras.layers.BatchNormalization)
    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(y, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    return [v.numpy() - lr * g.numpy() for v, g in zip(model.trainable_variables, grads)]


def sync_bn_trained(how, **kwargs):
    """The trainable weights after one step of `how` (tape or fit) on the SyncBN model."""
    model = sync_bn_model(hvd.SyncBatchNormalization)
    x, y = sync_bn_data(R)
    if how == "tape":
        opt = keras.optimizers.SGD(0.1)

        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = keras.losses.MeanSquaredError()(y, model(x, training=True))
            tape = hvd.DistributedGradientTape(tape, **kwargs)
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                    model.trainable_variables))
        _, events = recorded(step)
        marker = "DistributedGradientTape"
    else:
        model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1), **kwargs),
                      loss=keras.losses.MeanSquaredError())
        _, events = recorded(lambda: model.fit(x, y, batch_size=SBN_BATCH, epochs=1,
                                               shuffle=False, verbose=0))
        marker = "DistributedSGD"
    return [v.numpy() for v in model.trainable_variables], len(requests(events, marker))


@pytest.mark.parametrize("how", ["tape", "fit"])
def test_sync_batch_norm_trains_in_buckets_like_one_batch_and_like_one_group(how):
    # Its gradient is an allreduce made inside backprop: before the fix the step's graph
    # had a cycle (the buckets' ordering against tf.function's chain of stateful ops).
    got, n = sync_bn_trained(how)
    sizes = [int(np.prod(v.shape)) * 4 for v in sync_bn_model(keras.layers.BatchNormalization).trainable_variables]
    assert n == expected_requests(tf.float32, sizes)
    for g, w in zip(got, sync_bn_reference(0.1)):
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-5)
    one, _ = sync_bn_trained(how, num_groups=1)
    for g, o in zip(got, one):
        if N <= 2:  # the same sums: the same bits
            np.testing.assert_array_equal(g, o)
        else:
            np.testing.assert_allclose(g, o, rtol=1e-5, atol=1e-6)


def conv_model():
    """Two 3 x 3 convolutions of 256 channels: each kernel (2.4 MB) is over the bucket cap,
    so it and its bias fall in different buckets."""
    keras.utils.set_random_seed(7)
    return keras.Sequential([keras.Input((4, 4, 256)),
                             keras.layers.Conv2D(256, 3, padding="same", activation="tanh"),
                             keras.layers.Conv2D(256, 3, padding="same"),
                             keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(4)])


@pytest.mark.parametrize("how", ["tape", "fit"])
def test_a_convolution_whose_kernel_and_bias_are_in_two_buckets_trains_like_numpy(how):
    # TensorFlow's CPU rewrite (oneDNN, on by default) makes one node of a convolution's
    # filter gradient and its bias gradient. The buckets' ordering had made the filter
    # gradient wait for the enqueue of the bucket holding the bias gradient, which closed
    # a cycle through that node: "7944 nodes in a cycle" for a keras.applications ResNet-50.
    model = conv_model()
    plan = bucket_plan.plan([int(np.prod(v.shape)) * 4 for v in model.trainable_variables], CAP)
    where = {i: b for b, members in enumerate(plan) for i in members}
    assert where[2] != where[3], plan  # (the second convolution's kernel and bias)
    rng = np.random.RandomState(100 + R)
    x = rng.normal(size=(2, 4, 4, 256)).astype(np.float32)
    y = rng.normal(size=(2, 4)).astype(np.float32)
    start = [v.numpy() for v in model.trainable_variables]
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
    local = [g.numpy().astype(np.float64) for g in tape.gradient(loss, model.trainable_variables)]
    want = [np.mean(gs, axis=0) for gs in zip(*COMM.allgather(local))]  # (mpi4py's)
    if how == "tape":
        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
            return hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
        got = [g.numpy() for g in step(tf.constant(x), tf.constant(y))]
    else:  # one SGD(1.0) step of fit: the weights move by the averaged gradient
        model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(1.0)),
                      loss=keras.losses.MeanSquaredError())
        model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
        got = [w0 - v.numpy() for w0, v in zip(start, model.trainable_variables)]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-5)


def legacy_forward_allreduce_step(**kwargs):
    """The legacy optimizer in a TF1 graph whose forward pass averages an activation over
    the ranks with hvd.allreduce (its gradient is an allreduce inside backprop)."""
    x, y = data(R)
    init = legacy_initial()
    with tf.Graph().as_default():
        variables = [tf.compat.v1.Variable(w) for w in init]
        h = tf.constant(x)
        for k in range(0, len(variables) - 2, 2):
            h = tf.tanh(h @ variables[k] + variables[k + 1])
            if k == 2:
                h = hvd.allreduce(h, name="forward_mean")
        loss = tf.reduce_mean(tf.square(h @ variables[-2] + variables[-1] - y))
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.05), **kwargs)
        train = opt.minimize(loss, var_list=variables)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for _ in range(2):
                sess.run(train)
            return sess.run(variables), [w.nbytes for w in init]


def test_legacy_optimizer_with_an_allreduce_inside_backprop_trains_like_one_group():
    got, sizes = legacy_forward_allreduce_step()
    one, _ = legacy_forward_allreduce_step(num_groups=1)
    assert all(np.all(np.isfinite(g)) for g in got)
    for g, o in zip(got, one):
        if N <= 2:
            np.testing.assert_array_equal(g, o)
        else:
            np.testing.assert_allclose(g, o, rtol=1e-5, atol=1e-6)
    # ... and the weights of the layers below the allreduce moved (its gradient reached them)
    assert not np.array_equal(got[0], legacy_initial()[0])


def legacy_initial():
    return [np.random.RandomState(20 + k).normal(0, 0.05, size=s).astype(np.float32)
            for k, s in enumerate([(WIDTH, WIDTH), (WIDTH,)] * 4 + [(WIDTH, 4), (4,)])]


def test_a_collective_near_the_output_still_lets_the_buckets_below_it_leave_early():
    # SyncBatchNormalization after the last hidden layer only: its gradient's collective
    # comes first in backprop, and every bucket below it is still held in backprop's order.
    _overlap_needs()
    assert EXPECT, "the driver runs this case only where buckets are expected"
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((WIDTH,))] +
                             [keras.layers.Dense(WIDTH, activation="tanh") for _ in range(LAYERS)] +
                             [hvd.SyncBatchNormalization(), keras.layers.Dense(4)])
    step = tape_step(model)
    step()
    n = expected_requests(tf.float32, [int(np.prod(v.shape)) * 4 for v in model.trainable_variables])
    assert bucket_enqueues_waited_for(traced(step)) >= n - 2


# ---- gradients that are None on some ranks only ----

def skipping_model():
    keras.utils.set_random_seed(17)
    layers = [keras.layers.Dense(WIDTH, activation="tanh") for _ in range(5)] + [keras.layers.Dense(4)]
    return keras.Sequential([keras.Input((WIDTH,))] + layers), layers


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_a_gradient_none_on_one_rank_only_fails_every_rank_at_once_naming_it(mode):
    # Rank 1 skips a middle layer (a data-dependent branch eagerly, a rank-dependent trace
    # in a function): its gradients there are None. With buckets this waited for ever (the
    # buckets were cut and named differently); now every rank gets the mismatch at once,
    # naming the variable and both ranks, and the runtime works afterwards.
    if N < 2:
        pytest.skip("needs at least two ranks")
    model, layers = skipping_model()
    x = tf.constant(data(R)[0])

    def step(skip):
        with tf.GradientTape() as tape:
            h = x
            for k, layer in enumerate(layers):
                if not (skip and k == 2):
                    h = layer(h)
            loss = tf.reduce_mean(h)
        return hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
    run = step if mode == "eager" else tf.function(step)
    with pytest.raises(tf.errors.OpError, match=r"mismatched .*shapes?: ranks? 0(, \d+)* had .*rank 1 had") as info:
        run(R == 1)
    # A None gradient travels as shape (0,) in its place: the message shows which it is
    # (and names it where it is the first of its bucket, as here with small buckets).
    assert "(0,)" in str(info.value)
    if mode == "eager":  # one request, and the error names the variables themselves
        skipped = layers[2].name
        assert re.search(rf"the gradients of \S*{skipped}/kernel, \S*{skipped}/bias;", str(info.value))
    got = (step if mode == "eager" else tf.function(step))(False)  # every rank whole again
    assert all(g is not None for g in got)


def test_a_gradient_none_on_every_rank_stays_none_in_buckets():
    model, layers = skipping_model()
    x = tf.constant(data(R)[0])

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            h = x
            for k, layer in enumerate(layers):
                if k != 2:
                    h = layer(h)
            loss = tf.reduce_mean(h)
        return hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
    got = step()
    assert [g is None for g in got] == [k in (4, 5) for k in range(len(got))]
    with tf.GradientTape() as tape:  # plain TensorFlow, this rank's own gradients
        h = x
        for k, layer in enumerate(layers):
            if k != 2:
                h = layer(h)
        loss = tf.reduce_mean(h)
    local = tape.gradient(loss, model.trainable_variables)
    every = COMM.allgather([None if g is None else g.numpy().astype(np.float64) for g in local])
    for k, g in enumerate(got):
        if g is not None:
            np.testing.assert_allclose(g.numpy(), np.mean([e[k] for e in every], axis=0),
                                       rtol=1e-5, atol=1e-6)
