"""Rank side: Horovod 0.28.1's TensorFlow API as a drop-in — positional parameters and
defaults, the error classes Horovod raises, uint16/int16, IndexedSlices, process-set
keywords, and TF1 sessions running many independent collectives without deadlock.

Run by tests/test_matrix_tensorflow.py under mpirun -np 1..4; references are built
with NumPy from every rank's known input.
"""
import os
import threading
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import pytest
import tensorflow as tf

import horolite.tensorflow as hvd
from horolite.core.mpi_library import MPI  # the job world's: mpi4py's under mpirun
from tf_modes import MODES, NATIVE, run, value
from float16_sums import rounding_sums

hvd.init()
R, N = hvd.rank(), hvd.size()


def everyone(shape=(2, 3), dtype=np.float32):
    return [value(r, shape, dtype) for r in range(N)]


# ------------------------------------------------------ positional order ----

@pytest.mark.parametrize("mode", MODES)
def test_second_positional_is_average_as_in_horovod(mode):
    x = value(R)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        avg, total, grouped = run(mode, lambda t: (hvd.allreduce(t, True), hvd.allreduce(t, False),
                                                   hvd.grouped_allreduce([t, 2 * t], False)), x)
    np.testing.assert_allclose(avg, np.mean(everyone(), axis=0), rtol=1e-6)
    np.testing.assert_allclose(total, np.sum(everyone(), axis=0), rtol=1e-6)
    np.testing.assert_allclose(grouped[1], 2 * np.sum(everyone(), axis=0), rtol=1e-6)


def test_op_none_is_average_and_keywords_are_accepted():
    x = tf.constant(value(R))
    out = hvd.allreduce(x, op=None, device_dense="/cpu:0", device_sparse="/cpu:0",
                        process_set=hvd.global_process_set, ignore_name_scope=True, name="kw")
    np.testing.assert_allclose(out.numpy(), np.mean(everyone(), axis=0), rtol=1e-6)
    with pytest.raises(ValueError, match="supersedes average"):
        hvd.allreduce(x, average=True, op=hvd.Sum)
    with pytest.warns(DeprecationWarning, match="average"):
        hvd.allreduce(x, average=False)
    gathered = hvd.allgather(x, process_set=hvd.global_process_set, ignore_name_scope=False)
    np.testing.assert_array_equal(gathered.numpy(), np.concatenate(everyone()))
    np.testing.assert_array_equal(hvd.broadcast(x, 0, None, False, hvd.global_process_set).numpy(),
                                  value(0))
    grouped = hvd.grouped_allgather([x], process_set=hvd.global_process_set)
    assert len(grouped) == 1
    np.testing.assert_array_equal(grouped[0].numpy(), np.concatenate(everyone()))
    assert hvd.global_process_set.size() == N and hvd.global_process_set.rank() == R
    assert hvd.global_process_set.included() and hvd.global_process_set.ranks == list(range(N))
    assert int(hvd.size_op(process_set_id=0)) == N and int(hvd.process_set_included_op()) == 1


def test_unregistered_process_sets_are_refused_naming_the_set():
    subset = hvd.ProcessSet([0])  # never passed to init() nor add_process_set()
    for call in (lambda: hvd.allreduce(tf.ones(2), process_set=subset),
                 lambda: hvd.DistributedGradientTape(tf.GradientTape(), process_set=subset)
                 if R == 0 else hvd.allreduce(tf.ones(2), process_set=subset)):
        with pytest.raises(hvd.InvalidCollectiveError, match=r"ranks=\[0\].*not registered"):
            call()
    with pytest.raises(ValueError, match="HOROVOD_DYNAMIC_PROCESS_SETS=1"):
        hvd.add_process_set([0])


@pytest.mark.parametrize("mode", MODES)
def test_reducescatter_scale_factors(mode):
    x = value(R, (2 * N + 1, 2))
    out = run(mode, lambda t: hvd.reducescatter(t, op=hvd.Sum, prescale_factor=0.5,
                                                postscale_factor=3.0), x)
    full = 1.5 * np.sum(everyone((2 * N + 1, 2)), axis=0)
    base, extra = divmod(2 * N + 1, N)
    start = R * base + min(R, extra)
    np.testing.assert_allclose(out, full[start:start + base + (R < extra)], rtol=1e-6)
    g = run(mode, lambda t: hvd.grouped_reducescatter([t], op=hvd.Average, postscale_factor=2.0), x)
    np.testing.assert_allclose(g[0], 2 * np.mean(everyone((2 * N + 1, 2)), axis=0)[start:start + base + (R < extra)],
                               rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_float16_reducescatter_scales_as_horovod(mode):
    # Horovod's test_horovod_reducescatter_cpu_{pre,post}scale: the scaling is done in
    # float32 on the float16 sum, and the gradient is scaled by both factors.
    inputs, total = rounding_sums((4 * N + 1, 3), N, 11)
    base, extra = divmod(4 * N + 1, N)
    start, rows = R * base + min(R, extra), base + (R < extra)

    def fn(t):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(t)
            one = hvd.reducescatter(t, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.7391)
            grouped = hvd.grouped_reducescatter([t], op=hvd.Average, prescale_factor=2.0,
                                                postscale_factor=0.7391)
        return one, grouped, tape.gradient(one, t), tape.gradient(grouped, t)
    one, grouped, g_one, g_grouped = run(mode, fn, inputs[R])
    doubled = (2 * total).astype(np.float16).astype(np.float32)
    for got, factor in ((one, np.float32(0.7391)), (grouped[0], np.float32(0.7391 / N))):
        want = (factor * doubled).astype(np.float16)[start:start + rows]
        assert got.dtype == np.float16 and np.array_equal(got.view(np.uint16), want.view(np.uint16))
    # Horovod's gradient: allgather(dy * size (Sum) * prescale * postscale), in float16
    f16 = np.float16
    np.testing.assert_array_equal(g_one, np.full_like(inputs[R], f16(f16(f16(N) * f16(2.0)) * f16(0.7391))))
    np.testing.assert_array_equal(g_grouped, np.full_like(inputs[R], f16(f16(2.0) * f16(0.7391))))


# -------------------------------------------------------------- dtypes ----

@pytest.mark.parametrize("dtype", [np.uint16, np.int16])
@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_uint16_int16_every_collective(dtype, mode):
    x = value(R, (N, 2), dtype)

    def fn(t):
        return (hvd.allreduce(t, op=hvd.Sum), hvd.allgather(t), hvd.broadcast(t, N - 1),
                hvd.alltoall(t), hvd.reducescatter(t, op=hvd.Sum),
                hvd.grouped_allgather([t, t])[1], hvd.allreduce(t, op=hvd.Max))
    total, gathered, bcast, a2a, rs, gg, mx = run(mode, fn, x)
    allx = everyone((N, 2), dtype)
    assert total.dtype == dtype
    np.testing.assert_array_equal(total, np.sum(allx, axis=0).astype(dtype))
    np.testing.assert_array_equal(gathered, np.concatenate(allx))
    np.testing.assert_array_equal(gg, np.concatenate(allx))
    np.testing.assert_array_equal(bcast, allx[N - 1])
    np.testing.assert_array_equal(a2a, np.stack([a[R] for a in allx]))
    np.testing.assert_array_equal(rs, np.sum(allx, axis=0).astype(dtype)[R:R + 1])
    np.testing.assert_array_equal(mx, np.max(allx, axis=0))


# ------------------------------------------------------- error classes ----

@pytest.mark.skipif(N < 2, reason="a mismatch needs two ranks")
@pytest.mark.parametrize("mode", MODES)
def test_error_classes_are_horovods(mode):
    if mode != "eager" and not NATIVE:
        pytest.skip("HOROLITE_TF_NATIVE_OPS=0 in this run: TensorFlow picks a Python op's error class")
    shape = np.ones((R + 1, 2), np.float32)
    cases = [
        (tf.errors.FailedPreconditionError, "shape", lambda t: hvd.allreduce(t, name="mm.shape"), shape),
        (tf.errors.FailedPreconditionError, "dtype",
         lambda t: hvd.allgather(tf.cast(t, tf.int32 if R else tf.float32), name="mm.dtype"),
         np.ones((1, 2), np.float32)),
        (tf.errors.FailedPreconditionError, "root", lambda t: hvd.broadcast(t, R, name="mm.root"),
         np.ones(3, np.float32)),
        (tf.errors.InvalidArgumentError, "mm.a2a", lambda t: hvd.alltoall(t, name="mm.a2a"),
         np.ones(N + 1, np.float32)),
    ]
    for cls, words, fn, x in cases:
        with pytest.raises(cls, match=words) as info:
            run(mode, fn, x)
        assert "mm." in str(info.value)
    # and the runtime keeps working
    np.testing.assert_allclose(run(mode, lambda t: hvd.allreduce(t, op=hvd.Sum), np.ones(2, np.float32)),
                               np.full(2, N))


# ------------------------------------------------------ IndexedSlices ----

@pytest.mark.parametrize("mode", MODES)
def test_indexed_slices_as_horovod(mode):
    v, i = np.full((1, 2), R + 1, np.int32), np.array([R], np.int64)

    def fn(values, indices):
        s = tf.IndexedSlices(values, indices)  # no dense_shape
        avg = hvd.allreduce(s)
        total = hvd.allreduce(tf.IndexedSlices(tf.cast(values, tf.float32), indices), op=hvd.Sum)
        mixed = hvd.grouped_allreduce([s, tf.cast(values, tf.float32)], op=hvd.Sum)
        return avg.values, avg.indices, total.values, mixed[0].values, mixed[1]
    avg_v, avg_i, total_v, mixed_v, mixed_d = run(mode, fn, v, i)
    ranks = np.arange(1, N + 1)
    assert avg_v.dtype == np.float64  # Horovod: integer values / size
    np.testing.assert_allclose(avg_v[:, 0], ranks / N)
    np.testing.assert_array_equal(avg_i, np.arange(N))
    np.testing.assert_allclose(total_v[:, 1], ranks)
    np.testing.assert_array_equal(mixed_v[:, 0], ranks)
    np.testing.assert_allclose(mixed_d, np.full((1, 2), ranks.sum()))
    s = tf.IndexedSlices(tf.constant(v), tf.constant(i))
    for op in (hvd.Min, hvd.Max):
        with pytest.raises(NotImplementedError, match="Only Sum and Average"):
            hvd.grouped_allreduce([s], op=op)
    with pytest.raises(NotImplementedError, match="Pre/postscale"):
        hvd.allreduce(s, prescale_factor=2.0)


# ------------------------------------------------------ TF1 sessions ----

@pytest.mark.parametrize("threads", [0, 1])
def test_tf1_session_many_independent_collectives_cannot_deadlock(threads):
    # Horovod's graph tests: many independent collectives in one session.run. Odd ranks
    # build them in the opposite order, so TensorFlow runs them in different orders on
    # different ranks; a wait must never hold the (here possibly single) inter-op thread.
    if not NATIVE:
        pytest.skip("HOROLITE_TF_NATIVE_OPS=0 in this run (a Python wait op holds a thread)")
    count = 24
    order = range(count) if R % 2 == 0 else reversed(range(count))
    with tf.Graph().as_default():
        outs = {}
        for k in order:
            x = tf.constant(value(R, (N, 3)) + k)
            outs[k] = (hvd.allreduce(x, op=hvd.Sum, name=f"many.ar.{k}"),
                       hvd.reducescatter(x, op=hvd.Sum, name=f"many.rs.{k}"))
        config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=threads)
        result = {}
        with tf.compat.v1.Session(config=config) as sess:
            worker = threading.Thread(target=lambda: result.update(sess.run(outs)), daemon=True)
            worker.start()
            worker.join(120)
            assert not worker.is_alive(), "session.run of independent collectives hung"
    for k in range(count):
        full = np.sum(everyone((N, 3)), axis=0) + N * k
        np.testing.assert_allclose(result[k][0], full)
        np.testing.assert_allclose(result[k][1], full[R:R + 1])


# ------------------------------------------------- functions and tape ----

def test_function_keywords_of_horovod():
    v = tf.Variable(value(R))
    hvd.broadcast_variables([v], 0, hvd.global_process_set, True)
    np.testing.assert_array_equal(v.numpy(), value(0))
    assert hvd.broadcast_object({"r": R}, 0, None, "obj") == {"r": 0}
    assert hvd.allgather_object(R, None, "objs") == list(range(N))
    w, local = tf.Variable(np.ones(2, np.float32) * (R + 1)), tf.Variable(np.ones(2, np.float32))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * w) + tf.reduce_sum(local * (R + 1))
    tape = hvd.PartialDistributedGradientTape(tape, scale_local_gradients=False)
    tape.register_local_source(local)
    local_pairs, global_pairs = tape.get_local_and_global_gradients(loss, [w, local])
    assert [s is local for s, _ in local_pairs] == [True] and [s is w for s, _ in global_pairs] == [True]
    np.testing.assert_allclose(local_pairs[0][1].numpy(), np.full(2, R + 1.0))
    np.testing.assert_allclose(global_pairs[0][1].numpy(), np.full(2, 2 * np.mean(np.arange(1, N + 1))))


def test_horolite_keras_is_horovod_keras():
    import horolite.keras as khvd
    x = value(R)
    np.testing.assert_allclose(khvd.allreduce(x).numpy(), np.mean(everyone(), axis=0), rtol=1e-6)
    np.testing.assert_allclose(khvd.allreduce(x, average=None, op=khvd.Sum).numpy(),
                               np.sum(everyone(), axis=0), rtol=1e-6)
    with pytest.raises(ValueError, match="supersedes"):
        khvd.allreduce(x, op=khvd.Sum)  # horovod.keras: average=True by default
    np.testing.assert_array_equal(khvd.broadcast(x, N - 1).numpy(), value(N - 1))
    assert callable(khvd.callbacks.BestModelCheckpoint)


# ------------------------------------------------- Keras 3, first week ----

def keras_step_data():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(4 * N, 3)).astype(np.float32)
    y = rng.normal(size=(4 * N, 2)).astype(np.float32)
    return x, y


def dense_model(keras):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.set_weights([np.full((3, 2), 0.1, np.float32), np.zeros(2, np.float32)])
    return model


def diverge_tf_op_counters():
    """Make TensorFlow's process-wide op counter differ between ranks (rank r traces r extra
    tf.cond functions), as any rank-dependent graph building earlier in a job does: control
    flow graphs are named with that counter (`cond_true_1234`)."""
    for _ in range(R + 1):
        tf.function(lambda: tf.cond(tf.constant(True), lambda: 1.0, lambda: 2.0)).get_concrete_function()


def run_guarded(fn, seconds=120):
    """fn() in a thread; fails instead of hanging the job when the ranks disagree."""
    result = {}
    worker = threading.Thread(target=lambda: result.update(out=fn()), daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), "ranks submitted collectives that no other rank matched"
    return result["out"]


def test_collectives_in_control_flow_agree_when_ranks_built_different_graphs():
    diverge_tf_op_counters()

    @tf.function
    def step(x):
        y = tf.cond(tf.reduce_sum(x) > -1.0, lambda: hvd.allreduce(x, op=hvd.Sum), lambda: x)
        return tf.while_loop(lambda i, z: i < 2, lambda i, z: (i + 1, hvd.allreduce(z, op=hvd.Sum)),
                             (tf.constant(0), y))[1]
    out = run_guarded(lambda: step(tf.constant(value(R))).numpy())
    np.testing.assert_allclose(out, N * N * np.sum(everyone(), axis=0), rtol=1e-6)


@pytest.mark.parametrize("nesting", ["distributed_outside",
                                     "loss_scale_outside",
                                     "jit_compile"])
def test_keras_fit_loss_scale_and_xla_train_as_one_process(nesting):
    import horolite.tensorflow.keras as khvd
    keras = tf.keras
    x, y = keras_step_data()
    sgd = keras.optimizers.SGD(0.1)
    if nesting == "distributed_outside":
        opt = khvd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(sgd))
    elif nesting == "loss_scale_outside":
        opt = keras.optimizers.LossScaleOptimizer(khvd.DistributedOptimizer(sgd))
    else:
        opt = khvd.DistributedOptimizer(sgd)
    model = dense_model(keras)
    model.compile(optimizer=opt, loss="mse", jit_compile=nesting == "jit_compile")
    assert not model.jit_compile  # XLA cannot run the collectives: turned off, with a warning
    mine = slice(4 * R, 4 * R + 4)
    diverge_tf_op_counters()
    run_guarded(lambda: model.fit(x[mine], y[mine], batch_size=4, epochs=3, shuffle=False, verbose=0))
    ref = dense_model(keras)  # one process, the global batch
    ref.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=False)
    ref.fit(x, y, batch_size=4 * N, epochs=3, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_keras_loss_scale_outside_agrees_when_one_rank_overflows():
    # Rank 0's gradients overflow: every rank must skip the step together (and halve the
    # scale), instead of rank 0 skipping the inner optimizer's allreduce while others wait.
    import horolite.tensorflow.keras as khvd
    keras = tf.keras
    x, y = keras_step_data()
    mine = slice(4 * R, 4 * R + 4)
    xs = x[mine] * (1e30 if R == 0 else 1.0)
    opt = keras.optimizers.LossScaleOptimizer(khvd.DistributedOptimizer(keras.optimizers.SGD(0.1)))
    model = dense_model(keras)
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    before = [w.copy() for w in model.get_weights()]
    scale = float(opt.initial_scale)
    diverge_tf_op_counters()
    run_guarded(lambda: model.fit(xs, y[mine], batch_size=4, epochs=1, shuffle=False, verbose=0))
    for got, want in zip(model.get_weights(), before):
        np.testing.assert_array_equal(got, want)
    assert float(opt.dynamic_scale.numpy()) == scale / 2


@pytest.mark.parametrize("nesting", ["distributed_outside", "loss_scale_outside"])
def test_keras_mixed_float16_dynamic_loss_scale_skips_the_same_steps_as_one_process(nesting):
    # float16 forward passes, a dynamic loss scale that grows every 2 finite steps, and two
    # global batches with a row of 1e30 (inf in float16) on one rank: every rank skips
    # those steps and halves the scale, as one process on the whole batch does.
    import horolite.tensorflow.keras as khvd
    keras = tf.keras
    steps, bad = 6, {1: 0, 4: N - 1}  # global batch -> the rank whose rows overflow
    rng = np.random.default_rng(11)
    x = rng.normal(size=(steps * 4 * N, 3)).astype(np.float32)
    y = rng.normal(size=(steps * 4 * N, 2)).astype(np.float32)
    for k, r in bad.items():
        x[k * 4 * N + 4 * r + 1] = 1e30

    def rows_of(r):
        return np.concatenate([np.arange(k * 4 * N + 4 * r, k * 4 * N + 4 * r + 4) for k in range(steps)])

    def loss_scaled(opt):
        return keras.optimizers.LossScaleOptimizer(opt, initial_scale=256.0, dynamic_growth_steps=2)

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        sgd = keras.optimizers.SGD(0.1)
        if nesting == "distributed_outside":
            opt = khvd.DistributedOptimizer(loss_scaled(sgd))
        else:
            opt = loss_scaled(khvd.DistributedOptimizer(sgd))
        model = dense_model(keras)
        model.compile(optimizer=opt, loss="mse", jit_compile=False)
        diverge_tf_op_counters()
        mine = rows_of(R)
        run_guarded(lambda: model.fit(x[mine], y[mine], batch_size=4, epochs=1, shuffle=False, verbose=0))
        ref_opt = loss_scaled(keras.optimizers.SGD(0.1))
        ref = dense_model(keras)  # one process, the global batch
        ref.compile(optimizer=ref_opt, loss="mse", jit_compile=False)
        ref.fit(x, y, batch_size=4 * N, epochs=1, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    # scale 256: step 0 | skip 1 -> 128 | steps 2, 3 -> 256 | skip 4 -> 128 | step 5
    assert float(opt.dynamic_scale.numpy()) == float(ref_opt.dynamic_scale.numpy()) == 128.0
    assert int(opt.iterations.numpy()) == int(ref_opt.iterations.numpy())
    everyone_weights = MPI.COMM_WORLD.allgather(model.get_weights())  # mpi4py's, not horolite's
    for r, weights in enumerate(everyone_weights):
        for got, want in zip(weights, model.get_weights()):
            np.testing.assert_array_equal(got, want, err_msg=f"rank {r} differs from rank {R}")
    for got, want in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-3)
    assert np.all(np.isfinite(model.get_weights()[0]))


def test_keras_momentum_correction_scales_the_momentum_buffers():
    # Horovod: the step after a rate change uses momentum * new / old; horolite scales
    # SGD's momentum buffers by new / old instead, which gives the same update.
    import horolite.tensorflow.keras as khvd
    keras = tf.keras
    x, y = keras_step_data()

    def train(correction):
        model = dense_model(keras)
        model.compile(optimizer=khvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)),
                      loss="mse", jit_compile=False)
        cb = khvd.callbacks.LearningRateScheduleCallback(0.1, 0.5, momentum_correction=correction)
        model.fit(x, y, batch_size=4 * N, epochs=2, shuffle=False, verbose=0, callbacks=[cb])
        return model.get_weights()[0]

    # by hand: two SGD-with-momentum steps, lr 0.1 then 0.05, buffer scaled by 0.5 between
    w, b = np.full((3, 2), 0.1), np.zeros(2)
    m_w, m_b = np.zeros_like(w), np.zeros_like(b)
    for lr, factor in ((0.1, 1.0), (0.05, 0.5)):
        err = x @ w + b - y
        gw, gb = 2 * x.T @ err / err.size, 2 * err.sum(0) / err.size
        m_w, m_b = 0.9 * m_w * factor - lr * gw, 0.9 * m_b * factor - lr * gb
        w, b = w + m_w, b + m_b
    np.testing.assert_allclose(train(True), w, rtol=1e-5, atol=1e-6)
    assert not np.allclose(train(False), w, rtol=1e-5, atol=1e-6)


def test_keras_distributed_optimizer_variables_is_a_list_and_callable():
    # Horovod's TF2 examples call opt.variables() (a method in TF 2's Keras); Keras 3
    # made it a property. The wrapper's works both ways, and Keras still gets a list.
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1, momentum=0.9))
    v = tf.Variable(np.zeros(3, np.float32))
    opt.apply_gradients([(tf.constant(np.full(3, R + 1.0, np.float32)), v)])
    as_list, called = opt.variables, opt.variables()
    assert isinstance(as_list, list) and type(called) is list
    assert len(as_list) == len(called) >= 2  # iterations, the momentum slot
    assert all(a is b for a, b in zip(as_list, called))
    for var in called:
        var.assign(tf.cast(tf.fill(var.shape, R + 5), var.dtype))
    hvd.broadcast_variables(opt.variables(), root_rank=N - 1)
    for var in opt.variables:
        np.testing.assert_array_equal(var.numpy(), np.full(var.shape, N + 4))


def test_keras_distributed_optimizer_answers_keras_2s_lr():
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.Adam(0.001 * N))
    assert float(tf.keras.backend.get_value(opt.lr)) == pytest.approx(0.001 * N)
    opt.lr = 0.5
    assert float(opt.learning_rate.numpy()) == 0.5
    assert "lr" not in opt.get_config()  # what Keras saves is unchanged
