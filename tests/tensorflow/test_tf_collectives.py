"""Rank side: every collective eagerly, in tf.function and in a TF1 graph, their
gradients, compression, broadcasts of variables and objects, and the errors.

Run by tests/test_matrix_tensorflow.py under mpirun -np 1..4. Each rank's input
is a known function of its rank, so every result has a NumPy reference.
"""
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import pytest
import tensorflow as tf

import horolite
import horolite.tensorflow as hvd
from horolite.tensorflow import native_ops
from horolite.core.mpi_library import MPI  # the job world's: mpi4py's under mpirun
from tf_modes import MODES, NATIVE, run, value

hvd.init()
R, N = hvd.rank(), hvd.size()
GRAPH_MISMATCH_ERROR = tf.errors.FailedPreconditionError if NATIVE else tf.errors.InvalidArgumentError


@pytest.mark.parametrize("mode", ["function", "graph"])
def test_the_wait_op_in_graphs_is_the_one_this_run_expects(mode):
    # The native op where the driver did not turn it off (it must have built), else the
    # Python fallback: read from the graph the collectives are in.
    assert (native_ops.load() is not None) == NATIVE, "the native wait op did not load"
    x = tf.constant(value(R))
    if mode == "function":
        graph = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum)).get_concrete_function(x).graph
    else:
        graph = tf.Graph()
        with graph.as_default():
            hvd.allreduce(tf.constant(value(R)), op=hvd.Sum)
    types = {op.type for op in graph.get_operations()}
    if NATIVE:  # both native: no Python op runs on TensorFlow's threads
        assert {"HorolitEnqueue", "HorolitAsyncWait"} <= types, types
        assert not types & {"PyFunc", "EagerPyFunc"}, types
    else:
        assert "HorolitAsyncWait" not in types and types & {"PyFunc", "EagerPyFunc"}, types
    np.testing.assert_array_equal(run(mode, lambda t: hvd.allreduce(t, op=hvd.Sum), value(R)),
                                  sum(value(r) for r in range(N)))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.float16])
def test_allreduce_ops(mode, dtype):
    x = value(R, dtype=dtype)
    all_x = np.stack([value(r, dtype=dtype) for r in range(N)])
    out = run(mode, lambda t: [hvd.allreduce(t, op=hvd.Sum), hvd.allreduce(t, op=hvd.Max),
                                hvd.allreduce(t, op=hvd.Min)], x)
    np.testing.assert_allclose(out[0], all_x.sum(0), rtol=1e-3)
    np.testing.assert_array_equal(out[1], all_x.max(0))
    np.testing.assert_array_equal(out[2], all_x.min(0))
    assert out[0].dtype == dtype
    if np.issubdtype(dtype, np.floating):
        avg = run(mode, lambda t: hvd.allreduce(t, prescale_factor=2.0, postscale_factor=0.5), x)
        np.testing.assert_allclose(avg, all_x.astype(np.float64).mean(0), rtol=1e-3)


@pytest.mark.parametrize("mode", MODES)
def test_allreduce_variable_and_static_shape(mode):
    def fn(t):
        v = tf.Variable(t)
        if mode == "graph":
            return hvd.allreduce(t, op=hvd.Sum), tf.constant(0.0)
        out = hvd.allreduce(v, op=hvd.Sum)
        assert out.shape == (2, 3)
        return out, tf.constant(0.0)
    if mode == "function":  # variables must be created outside tf.function
        v = tf.Variable(value(R))
        out = tf.function(lambda: hvd.allreduce(v, op=hvd.Sum))()
        assert out.shape == (2, 3)
        np.testing.assert_allclose(out.numpy(), sum(value(r) for r in range(N)))
        return
    out = run(mode, fn, value(R))[0]
    np.testing.assert_allclose(out, sum(value(r) for r in range(N)))


@pytest.mark.parametrize("mode", MODES)
def test_grouped_allreduce(mode):
    xs = [value(R, (3,)), value(R, (2, 2), np.float64)]
    out = run(mode, lambda a, b: hvd.grouped_allreduce([a, b], op=hvd.Sum), *xs)
    np.testing.assert_allclose(out[0], sum(value(r, (3,)) for r in range(N)))
    np.testing.assert_allclose(out[1], sum(value(r, (2, 2)) for r in range(N)))


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_large_grouped_results_stay_intact_while_tensorflow_holds_them(mode):
    # Grouped results are 64-byte aligned views of a pooled buffer, so TensorFlow may
    # keep them without a copy; a buffer it still holds must never be reused.
    shapes = [(10,), (300, 129), (7,), (40_001,)]

    def reduce(*xs):
        return hvd.grouped_allreduce(list(xs), op=hvd.Sum, name="tf.group.big")

    fn = tf.function(reduce) if mode == "function" else reduce
    kept = []
    for step in range(4):
        xs = [tf.constant(value(R, s) * (step + 1)) for s in shapes]
        kept.append(fn(*xs))
    for step, outs in enumerate(kept):
        for s, out in zip(shapes, outs):
            np.testing.assert_allclose(out.numpy(), sum(value(r, s) for r in range(N)) * (step + 1))
            assert out.shape == s


@pytest.mark.parametrize("mode", MODES)
def test_allgather_uneven_and_bool(mode):
    x = value(R, (R + 1, 2))
    flags = np.array([R % 2 == 0] * (R + 1))
    out = run(mode, lambda t, f: [hvd.allgather(t), hvd.allgather(f)], x, flags)
    np.testing.assert_array_equal(out[0], np.concatenate([value(r, (r + 1, 2)) for r in range(N)]))
    np.testing.assert_array_equal(out[1], np.concatenate([[r % 2 == 0] * (r + 1) for r in range(N)]))


@pytest.mark.parametrize("mode", MODES)
def test_broadcast(mode):
    root = N - 1
    out = run(mode, lambda t: hvd.broadcast(t, root), value(R))
    np.testing.assert_array_equal(out, value(root))


@pytest.mark.parametrize("mode", MODES)
def test_alltoall(mode):
    # Equal parts: rank r sends 2 rows to every rank.
    x = value(R, (2 * N, 3))
    out = run(mode, lambda t: hvd.alltoall(t), x)
    expect = np.concatenate([value(r, (2 * N, 3))[2 * R:2 * R + 2] for r in range(N)])
    np.testing.assert_array_equal(out, expect)
    # Uneven splits: rank r sends (j + 1) rows to rank j.
    splits = np.arange(1, N + 1, dtype=np.int32)
    rows = int(splits.sum())
    out, received = run(mode, lambda t, s: hvd.alltoall(t, splits=s), value(R, (rows, 2)), splits)
    offsets = np.concatenate([[0], np.cumsum(splits)])
    expect = np.concatenate([value(r, (rows, 2))[offsets[R]:offsets[R + 1]] for r in range(N)])
    np.testing.assert_array_equal(out, expect)
    np.testing.assert_array_equal(received, [R + 1] * N)


@pytest.mark.parametrize("mode", MODES)
def test_reducescatter(mode):
    rows = 2 * N + 1
    x = value(R, (rows, 2))
    out = run(mode, lambda t: hvd.reducescatter(t, op=hvd.Sum), x)
    total = sum(value(r, (rows, 2)) for r in range(N))
    base, extra = divmod(rows, N)
    start = R * base + min(R, extra)
    mine = base + (1 if R < extra else 0)
    np.testing.assert_allclose(out, total[start:start + mine])


@pytest.mark.parametrize("mode", MODES)
def test_grouped_allgather_and_reducescatter(mode):
    # Results and gradients of both groups at once: loss = sum(w * outputs), w = rank + 1,
    # with the second member of each group weighted twice.
    a, b = value(R, (R + 1, 2)), value(R, (1, 3), np.float64)
    c, d = value(R, (N, 2)), value(R, (2 * N + 1, 1), np.float64)
    w = float(R + 1)

    def fn(a, b, c, d):
        with tf.GradientTape() as tape:
            tape.watch([a, b, c, d])
            ga, gb = hvd.grouped_allgather([a, b])
            rc, rd = hvd.grouped_reducescatter([c, d], op=hvd.Average)
            loss = tf.reduce_sum(w * ga) + tf.reduce_sum(2 * w * tf.cast(gb, tf.float32)) + \
                tf.reduce_sum(w * rc) + tf.reduce_sum(2 * w * tf.cast(rd, tf.float32))
        return [ga, gb, rc, rd] + tape.gradient(loss, [a, b, c, d])

    if mode == "graph":
        with tf.Graph().as_default():
            ts = [tf.constant(v) for v in (a, b, c, d)]
            ga, gb = hvd.grouped_allgather(ts[:2])
            rc, rd = hvd.grouped_reducescatter(ts[2:], op=hvd.Average)
            loss = tf.reduce_sum(w * ga) + tf.reduce_sum(2 * w * tf.cast(gb, tf.float32)) + \
                tf.reduce_sum(w * rc) + tf.reduce_sum(2 * w * tf.cast(rd, tf.float32))
            # Six collectives (two groups, four in the gradients) that TF1 may run in any
            # order, each holding an inter-op thread while it waits: the session needs a
            # thread for each (see docs/tensorflow.md's TF1 note).
            config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=6, use_per_session_threads=True)
            with tf.compat.v1.Session(config=config) as sess:
                out = sess.run([ga, gb, rc, rd] + tf.compat.v1.gradients(loss, ts))
    else:
        out = run(mode, fn, a, b, c, d)
    ga, gb, rc, rd, da, db, dc, dd = out
    np.testing.assert_array_equal(ga, np.concatenate([value(r, (r + 1, 2)) for r in range(N)]))
    np.testing.assert_array_equal(gb, np.concatenate([value(r, (1, 3), np.float64) for r in range(N)]))
    np.testing.assert_allclose(rc, np.mean([value(r, (N, 2)) for r in range(N)], axis=0)[R:R + 1])
    base, extra = divmod(2 * N + 1, N)
    owner = np.concatenate([[r] * (base + (1 if r < extra else 0)) for r in range(N)])
    start = R * base + min(R, extra)
    full_d = np.mean([value(r, (2 * N + 1, 1), np.float64) for r in range(N)], axis=0)
    np.testing.assert_allclose(rd, full_d[start:start + len(rd)])
    wsum = sum(r + 1.0 for r in range(N))
    # Horovod's gradients: allgather averages; reducescatter(Average) is the allgather.
    np.testing.assert_allclose(da, np.full(a.shape, wsum / N), rtol=1e-6)
    np.testing.assert_allclose(db, np.full(b.shape, 2 * wsum / N), rtol=1e-6)
    np.testing.assert_allclose(dc, np.repeat((np.arange(N) + 1.0)[:, None], 2, axis=1), rtol=1e-6)
    np.testing.assert_allclose(dd, 2 * (owner[:, None] + 1.0), rtol=1e-6)


def grads_of(mode, fn, x):
    """d(sum(w * fn(x)))/dx with a rank-dependent weight w = rank + 1."""
    w = float(R + 1)

    def g(t):
        with tf.GradientTape() as tape:
            tape.watch(t)
            y = fn(t)
            loss = tf.reduce_sum(w * tf.cast(y, tf.float32))
        return tape.gradient(loss, t)

    if mode == "graph":
        with tf.Graph().as_default():
            t = tf.constant(x)
            loss = tf.reduce_sum(w * fn(t))
            grad = tf.compat.v1.gradients(loss, t)[0]
            with tf.compat.v1.Session() as sess:
                return sess.run(grad)
    return run(mode, g, x)


@pytest.mark.parametrize("mode", MODES)
def test_gradients(mode):
    x = value(R)
    wsum = sum(r + 1.0 for r in range(N))
    # allreduce(Sum): d/dx = sum over ranks of the upstream gradient
    np.testing.assert_allclose(grads_of(mode, lambda t: hvd.allreduce(t, op=hvd.Sum), x),
                               np.full(x.shape, wsum))
    # allreduce(Average): the average of the upstream gradients
    np.testing.assert_allclose(grads_of(mode, lambda t: hvd.allreduce(t), x),
                               np.full(x.shape, wsum / N), rtol=1e-6)
    # allgather: the averaged upstream gradient of this rank's rows (Horovod >= 0.22)
    xg = value(R, (R + 1, 2))
    np.testing.assert_allclose(grads_of(mode, lambda t: hvd.allgather(t), xg), np.full(xg.shape, wsum / N),
                               rtol=1e-6)
    # broadcast: averaged on the root, zeros elsewhere
    expect = wsum / N if R == 0 else 0.0
    np.testing.assert_allclose(grads_of(mode, lambda t: hvd.broadcast(t, 0), x), np.full(x.shape, expect))
    # alltoall: gradient travels back to the sender; the weight is the receiver's
    xa = value(R, (N, 2))
    np.testing.assert_allclose(grads_of(mode, lambda t: hvd.alltoall(t), xa),
                               np.repeat(np.arange(1.0, N + 1)[:, None], 2, axis=1))
    # reducescatter(Sum): every row goes to one rank, which weights it; Horovod multiplies by size
    xr = value(R, (N, 2))
    np.testing.assert_allclose(grads_of(mode, lambda t: hvd.reducescatter(t, op=hvd.Sum), xr),
                               N * np.repeat(np.arange(1.0, N + 1)[:, None], 2, axis=1))


@pytest.mark.parametrize("mode", MODES)
def test_indexed_slices_allreduce(mode):
    def fn(v, i):
        s = tf.IndexedSlices(v, i, dense_shape=tf.constant([N, 2], tf.int64))
        out = hvd.allreduce(s)
        return tf.convert_to_tensor(out)
    v = np.full((1, 2), R + 1.0, np.float32)
    i = np.array([R], np.int64)
    out = run(mode, fn, v, i)
    expect = np.array([[r + 1.0, r + 1.0] for r in range(N)]) / N
    np.testing.assert_allclose(out, expect)
    for op in (hvd.Min, hvd.Max, hvd.Product):  # as Horovod: NotImplementedError
        with pytest.raises(NotImplementedError, match="IndexedSlices"):
            hvd.allreduce(tf.IndexedSlices(tf.constant(v), tf.constant(i)), op=op)


@pytest.mark.parametrize("mode", MODES)
def test_fp16_compression(mode):
    x = value(R) / 7.0
    out = run(mode, lambda t: hvd.allreduce(t, op=hvd.Sum, compression=hvd.Compression.fp16), x)
    assert out.dtype == np.float32
    expect = sum((value(r) / 7.0).astype(np.float16).astype(np.float32) for r in range(N))
    np.testing.assert_allclose(out, expect, rtol=2e-3)
    assert hvd.Compression.fp16.compress(tf.constant([1], tf.int32))[0].dtype == tf.int32


def test_broadcast_variables_eager_and_graph():
    tf.random.set_seed(R)  # differently initialised ranks
    variables = [tf.Variable(tf.random.normal([3, 2])), tf.Variable(R, dtype=tf.int64)]
    roots = MPI.COMM_WORLD.bcast([v.numpy() for v in variables], root=0)  # mpi4py's broadcast
    hvd.broadcast_variables(variables, root_rank=0)
    np.testing.assert_array_equal(variables[0].numpy(), roots[0])
    assert variables[1].numpy() == roots[1] == 0
    with tf.Graph().as_default():
        v = tf.compat.v1.get_variable("w", initializer=tf.constant(value(R)))
        bcast = hvd.broadcast_global_variables(root_rank=N - 1)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(bcast)
            np.testing.assert_array_equal(sess.run(v), value(N - 1))


def test_inplace_broadcast_eager_and_graph():
    # Horovod's broadcast_: assigns in place and returns the broadcast values.
    v, w = tf.Variable(value(R)), tf.Variable(float(R))
    got = hvd.broadcast_([v, w], root_rank=N - 1)
    np.testing.assert_array_equal(v.numpy(), value(N - 1))
    np.testing.assert_array_equal(got[0].numpy(), value(N - 1))
    w.assign(float(R + 5))
    assert float(hvd.broadcast_(w, 0).numpy()) == 5.0 == float(w.numpy())
    with tf.Graph().as_default():
        g = tf.compat.v1.get_variable("g", initializer=tf.constant(value(R)))
        out = hvd.broadcast_([g], root_rank=N - 1)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            np.testing.assert_array_equal(sess.run(out)[0], value(N - 1))
            np.testing.assert_array_equal(sess.run(g), value(N - 1))


def test_refusals_name_what_is_not_supported():
    with pytest.raises(hvd.InvalidCollectiveError, match="is not a ProcessSet"):
        hvd.broadcast_([tf.Variable(1.0)], 0, process_set=object())
    with pytest.raises(hvd.InvalidCollectiveError, match="is not a ProcessSet"):
        hvd.broadcast_object_fn(process_set=object())
    for call in (lambda: hvd.reducescatter(tf.ones([N, 2]), op=hvd.Max),
                 lambda: hvd.grouped_reducescatter([tf.ones([N, 2])], op=hvd.Max)):
        with pytest.raises(ValueError, match="reducescatter supports Average and Sum, not MAX"):
            call()


def test_broadcast_global_variables_hook():
    with tf.Graph().as_default():
        v = tf.compat.v1.get_variable("w", initializer=tf.constant(value(R)))
        step = tf.compat.v1.train.get_or_create_global_step()
        hooks = [hvd.BroadcastGlobalVariablesHook(0)]
        with tf.compat.v1.train.MonitoredSession(hooks=hooks) as sess:
            np.testing.assert_array_equal(sess.run(v), value(0))


def test_broadcast_and_allgather_object():
    obj = {"rank": R, "payload": list(range(R + 3))}
    assert hvd.broadcast_object(obj, root_rank=N - 1) == {"rank": N - 1, "payload": list(range(N + 2))}
    assert hvd.allgather_object(obj) == [{"rank": r, "payload": list(range(r + 3))} for r in range(N)]
    fn = hvd.broadcast_object_fn(root_rank=N - 1, name="objfn")
    assert fn(obj) == {"rank": N - 1, "payload": list(range(N + 2))}
    assert fn(("again", R)) == ("again", N - 1)


def test_join_and_barrier():
    hvd.barrier()
    last = hvd.join()
    assert 0 <= int(last) < N


def test_basics_reexported():
    assert hvd.rank() == R and hvd.size() == N and hvd.is_initialized()
    assert 0 <= hvd.local_rank() < hvd.local_size()
    assert isinstance(hvd.mpi_threads_supported(), bool)
    # the topology as ops, eagerly and in a graph
    ops = (hvd.rank_op, hvd.size_op, hvd.local_rank_op, hvd.local_size_op)
    expect = [R, N, hvd.local_rank(), hvd.local_size()]
    assert [int(op()) for op in ops] == expect
    assert [int(t) for t in tf.function(lambda: [op() for op in ops])()] == expect
    without_mpi = "HOROLITE_RANK" in os.environ  # (horolite-run --gloo)
    assert hvd.mpi_built() and hvd.gloo_built()
    assert hvd.mpi_enabled() != without_mpi and hvd.gloo_enabled() == without_mpi


def test_straggler_report_reexported():
    # A horolite addition (docs/stragglers.md): the NumPy API's report, every rank named;
    # the allreduces below reach it within about a second.
    assert hvd.straggler_report is horolite.straggler_report
    before = hvd.straggler_report()["rounds"]["total"]
    for _ in range(3):
        hvd.allreduce(tf.constant([1.0, 2.0]), name="straggler.tf")
    deadline = time.monotonic() + 10
    while N > 1 and hvd.straggler_report()["rounds"]["total"] < before + 3:
        assert time.monotonic() < deadline, hvd.straggler_report()
        time.sleep(0.05)
    report = hvd.straggler_report()
    assert sorted(report["ranks"]) == list(range(N)), report


@pytest.mark.skipif(N < 2, reason="a mismatch needs two ranks")
@pytest.mark.parametrize("mode", MODES)
def test_mismatch_error_names_tensor(mode):
    x = np.ones((R + 1,), np.float32)  # shapes differ between ranks
    if mode == "eager":
        with pytest.raises(tf.errors.FailedPreconditionError, match="bad_tensor") as info:
            hvd.allreduce(tf.constant(x), name="bad_tensor")
        assert "shape" in str(info.value)
    else:
        # Inside graphs the native wait op raises Horovod's class too; without it
        # TensorFlow picks the class of a Python op's error by the Python type.
        with pytest.raises(GRAPH_MISMATCH_ERROR, match="bad_tensor") as info:
            run(mode, lambda t: hvd.allreduce(t, name="bad_tensor"), x)
        assert "TensorMismatchError" in str(info.value) and "shape" in str(info.value)
    # The runtime survives a per-tensor error.
    np.testing.assert_allclose(hvd.allreduce(tf.constant([1.0]), op=hvd.Sum).numpy(), [N])


def test_broadcast_global_variables_in_a_graph_built_before_init():
    # Horovod's test_horovod_broadcast_graph_mode builds the op with horovod not
    # initialized (an earlier test shut it down): building needs no init, running does.
    hvd.shutdown()
    try:
        with tf.Graph().as_default():
            assert hvd.broadcast_global_variables(root_rank=0) is not None  # no variables
            v = tf.compat.v1.get_variable("late", initializer=tf.constant(value(R)))
            bcast = hvd.broadcast_global_variables(root_rank=N - 1)
            hvd.init()
            with tf.compat.v1.Session() as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                sess.run(bcast)
                np.testing.assert_array_equal(sess.run(v), value(N - 1))
    finally:
        if not hvd.is_initialized():
            hvd.init()
    assert hvd.rank() == R and hvd.size() == N
