"""Rank side: ModelAverageOptimizer, ElasticAverageOptimizer and SyncReplicasOptimizer
against a NumPy simulation of every rank, step by step: Keras 3 and legacy
optimizers, eager, tf.function, TF1 graphs and model.fit; the model-averaging
callback; a backup-worker run with one rank late at every step.

Run by tests/test_matrix_tensorflow.py under mpirun -np 1..4.
"""
import os
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import pytest
import tensorflow as tf

import horolite.tensorflow as hvd
import horolite.tensorflow.keras as hvdk
from horolite.core.mpi_library import MPI  # the job world's: mpi4py's under mpirun

hvd.init()
COMM = MPI.COMM_WORLD  # mpi4py's own allgather compares ranks, not horolite's
R, N = hvd.rank(), hvd.size()
LAST = N - 1
# The marker files' folder: the driver's, or a fresh one rank 0 makes (never /tmp itself,
# where an earlier run's markers would make the late rank not late).
OUTDIR = os.environ.get("HOROLITE_TEST_OUTDIR") or COMM.bcast(
    tempfile.mkdtemp(prefix="horolite-markers-") if COMM.Get_rank() == 0 else None)
BATCH = 24  # 6 rows per rank on 4 ranks
STEPS = 5
LR = 0.1
RNG = np.random.RandomState(1)
X = RNG.normal(size=(BATCH, 4)).astype(np.float32)
Y = RNG.normal(size=(BATCH, 2)).astype(np.float32)
W0 = RNG.normal(size=(4, 2)).astype(np.float32)
B0 = np.zeros(2, np.float32)


def shard(r):
    lo, hi = r * BATCH // N, (r + 1) * BATCH // N
    return X[lo:hi], Y[lo:hi]


def np_grads(w, b, r):
    x, y = shard(r)
    err = x @ w + b - y
    return 2 * x.T @ err / err.size, 2 * err.sum(0) / err.size


def simulate(algorithm, steps=STEPS, period=2, moving_rate=None, k=None):
    """Every rank's (w, b) after `steps` applications, and EASGD's center (NumPy, float64)."""
    ws = [(W0.astype(np.float64), B0.astype(np.float64)) for _ in range(N)]
    center = None
    rate = moving_rate if moving_rate is not None else 0.9 / (period * N)
    for step in range(1, steps + 1):
        grads = [np_grads(w, b, r) for r, (w, b) in enumerate(ws)]
        if algorithm == "sync":
            count = k or N
            gw = np.mean([g[0] for g in grads[:count]], axis=0)
            gb = np.mean([g[1] for g in grads[:count]], axis=0)
            ws = [(w - LR * gw, b - LR * gb) for w, b in ws]
            continue
        if algorithm == "easgd" and center is None:
            center = [np.mean([w[i] for w in ws], axis=0) for i in range(2)]
        ws = [(w - LR * g[0], b - LR * g[1]) for (w, b), g in zip(ws, grads)]
        if step % period:
            continue
        if algorithm == "average":
            mean = [np.mean([w[i] for w in ws], axis=0) for i in range(2)]
            ws = [tuple(mean) for _ in ws]
        else:
            diffs = [[rate * (w[i] - center[i]) for i in range(2)] for w in ws]
            ws = [(w[0] - d[0], w[1] - d[1]) for w, d in zip(ws, diffs)]
            center = [center[i] + sum(d[i] for d in diffs) for i in range(2)]
    return ws, center


def wrap(algorithm, optimizer, **kw):
    if algorithm == "average":
        return hvd.ModelAverageOptimizer(optimizer, interval_steps=2, **kw)
    if algorithm == "easgd":
        return hvd.ElasticAverageOptimizer(optimizer, communication_period=2, **kw)
    return hvd.SyncReplicasOptimizer(optimizer, **kw)


def check(algorithm, w, b, opt=None, k=None, atol=2e-5):
    """This rank's variables (and EASGD's centers) equal the simulation, and so do every
    other rank's, gathered with mpi4py: ranks that must agree do, and ranks that must
    differ (model averaging between two averaging steps) do too."""
    ws, center = simulate(algorithm, k=k)
    np.testing.assert_allclose(w, ws[R][0], atol=atol)
    np.testing.assert_allclose(b, ws[R][1], atol=atol)
    for r, (other_w, other_b) in enumerate(COMM.allgather((np.asarray(w), np.asarray(b)))):
        np.testing.assert_allclose(other_w, ws[r][0], atol=atol, err_msg=f"rank {r}'s kernel")
        np.testing.assert_allclose(other_b, ws[r][1], atol=atol, err_msg=f"rank {r}'s bias")
    if algorithm == "easgd":
        got = center_values(opt)
        for r, other in enumerate(COMM.allgather(got)):
            np.testing.assert_allclose(other[0], center[0], atol=atol, err_msg=f"rank {r}'s center")
            np.testing.assert_allclose(other[1], center[1], atol=atol, err_msg=f"rank {r}'s center")


def center_values(opt):
    return [np.asarray(c.numpy() if hasattr(c, "numpy") else c) for c in opt.center_variables]


ALGORITHMS = ["average", "easgd", "sync"]


def only_at(*sizes):
    """Cases that cost seconds each (tracing a legacy optimizer, model.fit) run at
    these job sizes only, to keep the suite's time; the rest runs at every size."""
    return pytest.mark.skipif(N not in sizes, reason=f"run at np {sizes} only (suite time)")


@pytest.mark.parametrize("kind,mode", [("keras", "eager"), ("legacy", "eager"),
                                       pytest.param("keras", "function", marks=only_at(2, 3)),
                                       pytest.param("legacy", "function", marks=only_at(3))])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_step_by_step_against_numpy(algorithm, kind, mode):
    w, b = tf.Variable(W0), tf.Variable(B0)
    x, y = (tf.constant(a) for a in shard(R))
    base = (tf.keras.optimizers.SGD(LR) if kind == "keras"
            else tf.compat.v1.train.GradientDescentOptimizer(LR))
    opt = wrap(algorithm, base)

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.matmul(x, w) + b - y))
        opt.apply_gradients(zip(tape.gradient(loss, [w, b]), [w, b]))

    step = tf.function(step) if mode == "function" else step
    for _ in range(STEPS):
        step()
    check(algorithm, w.numpy(), b.numpy(), opt)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_tf1_graph_against_numpy(algorithm):
    with tf.Graph().as_default():
        w = tf.compat.v1.Variable(W0)
        b = tf.compat.v1.Variable(B0)
        x, y = (tf.constant(a) for a in shard(R))
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) + b - y))
        opt = wrap(algorithm, tf.compat.v1.train.GradientDescentOptimizer(LR))
        train = opt.minimize(loss)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for _ in range(STEPS):
                sess.run(train)
            got_w, got_b = sess.run([w, b])
            centers = sess.run(opt.center_variables) if algorithm == "easgd" else None
    ws, center = simulate(algorithm)
    np.testing.assert_allclose(got_w, ws[R][0], atol=2e-5)
    np.testing.assert_allclose(got_b, ws[R][1], atol=2e-5)
    if centers is not None:
        np.testing.assert_allclose(centers[0], center[0], atol=2e-5)
        np.testing.assert_allclose(centers[1], center[1], atol=2e-5)


def _model():
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(2)])
    model.layers[0].set_weights([W0, B0])
    return model


@only_at(2, 3)
@pytest.mark.parametrize("algorithm", ["average", "easgd", "callback"])
def test_keras_fit_against_numpy(algorithm):
    """(SyncReplicasOptimizer in fit: test_backup_worker_is_dropped_every_step.)"""
    model = _model()
    if algorithm == "callback":
        opt, callbacks = tf.keras.optimizers.SGD(LR), [hvdk.callbacks.ModelAverageCallback(2)]
    else:
        wrapper = {"average": hvdk.ModelAverageOptimizer, "easgd": hvdk.ElasticAverageOptimizer,
                   "sync": hvdk.SyncReplicasOptimizer}[algorithm]
        opt, callbacks = wrap(algorithm, tf.keras.optimizers.SGD(LR)), []
        assert isinstance(opt, tf.keras.optimizers.SGD) and wrapper is getattr(hvd, wrapper.__name__)
    model.compile(optimizer=opt, loss="mse")
    x, y = shard(R)
    model.fit(x, y, batch_size=len(x), epochs=STEPS, shuffle=False, verbose=0, callbacks=callbacks)
    w, b = model.layers[0].get_weights()
    check("average" if algorithm == "callback" else algorithm, w, b, opt)
    assert int(opt.iterations.numpy()) == STEPS


def _mark(tag):
    open(os.path.join(OUTDIR, f"wrappers.{tag}"), "w").close()


def _wait_for(tag, timeout=60):
    path = os.path.join(OUTDIR, f"wrappers.{tag}")
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"rank {R}: no {path} after {timeout} s"
        time.sleep(0.005)


@pytest.mark.parametrize("mode", ["eager", "function", "keras-fit"])
def test_backup_worker_is_dropped_every_step(mode):
    """The last rank is late at every step (it starts step s only once rank 0 has
    applied step s): its gradients never count, yet its variables stay identical to
    everyone's, and equal the simulation aggregating ranks 0..N-2 only."""
    k = max(N - 1, 1)
    late = R == LAST and N > 1
    opt = hvd.SyncReplicasOptimizer(tf.keras.optimizers.SGD(LR), replicas_to_aggregate=k,
                                    total_num_replicas=N)
    if mode == "keras-fit":
        model = _model()
        model.compile(optimizer=opt, loss="mse")

        class Pace(tf.keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                if late:
                    _wait_for(f"fit.{self.epoch}")

            def on_epoch_begin(self, epoch, logs=None):
                self.epoch = epoch

            def on_train_batch_end(self, batch, logs=None):
                if R == 0:
                    _mark(f"fit.{self.epoch}")
        x, y = shard(R)
        model.fit(x, y, batch_size=len(x), epochs=STEPS, shuffle=False, verbose=0, callbacks=[Pace()])
        w, b = model.layers[0].get_weights()
    else:
        wv, bv = tf.Variable(W0), tf.Variable(B0)
        x, y = (tf.constant(a) for a in shard(R))

        def step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(tf.matmul(x, wv) + bv - y))
            opt.apply_gradients(zip(tape.gradient(loss, [wv, bv]), [wv, bv]))
        step = tf.function(step) if mode == "function" else step
        for s in range(STEPS):
            if late:
                _wait_for(f"{mode}.{s}")
            step()
            if R == 0:
                _mark(f"{mode}.{s}")
        w, b = wv.numpy(), bv.numpy()
    check("sync", w, b, k=k)


def test_constructor_errors():
    sgd = tf.keras.optimizers.SGD(LR)
    with pytest.raises(ValueError, match="interval_steps must be a positive integer, got 0"):
        hvd.ModelAverageOptimizer(sgd, interval_steps=0)
    with pytest.raises(ValueError, match="communication_period must be a positive integer"):
        hvd.ElasticAverageOptimizer(sgd, communication_period=1.5)
    with pytest.raises(ValueError, match=r"moving_rate must be in \(0, 1\]"):
        hvd.ElasticAverageOptimizer(sgd, moving_rate=0)
    with pytest.raises(ValueError, match=rf"replicas_to_aggregate must be an integer from 1 to {N}"):
        hvd.SyncReplicasOptimizer(sgd, replicas_to_aggregate=N + 1)
    with pytest.raises(ValueError, match=rf"total_num_replicas={N + 1}, but this job has {N} ranks"):
        hvd.SyncReplicasOptimizer(sgd, total_num_replicas=N + 1)
    with pytest.raises(TypeError, match="expected a Keras optimizer or a tf.compat.v1.train.Optimizer"):
        hvd.ModelAverageOptimizer(object())
    with pytest.raises(ValueError, match="interval_steps must be a positive integer"):
        hvdk.callbacks.ModelAverageCallback(0)


def test_easgd_default_moving_rate_and_centers_reachable():
    opt = hvd.ElasticAverageOptimizer(tf.keras.optimizers.SGD(LR), communication_period=4)
    assert opt._horolite_algorithm.moving_rate == pytest.approx(0.9 / (4 * N))
    w = tf.Variable(np.full(3, float(R), np.float32))
    opt.apply_gradients([(tf.zeros(3), w)])
    # The centers start from the variables' average over ranks, equal everywhere.
    np.testing.assert_allclose(opt.center_variable(w).numpy(), np.full(3, (N - 1) / 2))
    assert any(v is opt.center_variable(w) for v in opt.variables)  # saved with the optimizer
    with pytest.raises(ValueError, match="has no center variable"):
        opt.center_variable(tf.Variable(1.0))


@pytest.mark.parametrize("wrapper", ["distributed", "model_average", "sync"])
def test_legacy_wrappers_answer_for_the_wrapped_optimizers_slots(wrapper):
    # The slots live in the wrapped tf.compat.v1 optimizer; the wrapper hands them out.
    inner = tf.compat.v1.train.MomentumOptimizer(LR, momentum=0.9)
    opt = {"distributed": lambda: hvd.DistributedOptimizer(inner),
           "model_average": lambda: hvd.ModelAverageOptimizer(inner),
           "sync": lambda: hvd.SyncReplicasOptimizer(inner)}[wrapper]()
    w = tf.Variable(np.full(3, 1.0, np.float32))
    opt.apply_gradients([(tf.fill([3], float(R + 1)), w)])
    assert opt.get_slot_names() == inner.get_slot_names() == ["momentum"]
    assert opt.get_slot(w, "momentum") is inner.get_slot(w, "momentum")
    assert [v.ref() for v in opt.variables()] == [v.ref() for v in inner.variables()]
    assert opt.get_slot(w, "momentum").numpy().sum() != 0


@pytest.mark.parametrize("mode", ["eager"])
def test_a_straggler_several_steps_behind_finishes_after_the_others_left(mode):
    """Last in this file: ranks 0..N-2 run every step and shut down; only then does the
    last rank run its steps. Each was decided without it, so it applies the same
    updates: its variables equal the simulation of ranks 0..N-2 (as everyone's do), and
    it ends normally."""
    if N == 1:
        pytest.skip("needs a straggler")
    k = N - 1
    opt = hvd.SyncReplicasOptimizer(tf.keras.optimizers.SGD(LR), replicas_to_aggregate=k,
                                    total_num_replicas=N)
    wv, bv = tf.Variable(W0), tf.Variable(B0)
    x, y = (tf.constant(a) for a in shard(R))
    if R == LAST:
        for q in range(k):
            _wait_for(f"straggler.left.{q}")
    for _ in range(STEPS):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.matmul(x, wv) + bv - y))
        opt.apply_gradients(zip(tape.gradient(loss, [wv, bv]), [wv, bv]))
    if R != LAST:
        hvd.shutdown()
        _mark(f"straggler.left.{R}")
    ws, _ = simulate("sync", k=k)
    np.testing.assert_allclose(wv.numpy(), ws[R][0], atol=2e-5)
    np.testing.assert_allclose(bv.numpy(), ws[R][1], atol=2e-5)
