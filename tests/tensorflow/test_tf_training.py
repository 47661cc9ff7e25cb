"""Rank side: data-parallel training with the tape, the legacy optimizer and
Keras fit equals one process on the whole batch; local gradient aggregation;
sparse gradients; argument errors; the Keras callbacks.

Run by tests/test_matrix_tensorflow.py under mpirun -np 1..4.
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import pytest
import tensorflow as tf

import horolite.tensorflow as hvd
from tf_modes import NATIVE
from horolite.core.mpi_library import MPI  # the job world's: mpi4py's under mpirun

hvd.init()
COMM = MPI.COMM_WORLD  # mpi4py's own collectives: "equal on every rank" without horolite
R, N = hvd.rank(), hvd.size()
BATCH = 12  # divisible by 1, 2, 3 and 4 ranks
STEPS = 3
LR = 0.1
RNG = np.random.RandomState(0)
X = RNG.normal(size=(BATCH, 4)).astype(np.float32)
Y = RNG.normal(size=(BATCH, 2)).astype(np.float32)
W0 = RNG.normal(size=(4, 2)).astype(np.float32)
B0 = np.zeros(2, np.float32)
LO, HI = R * BATCH // N, (R + 1) * BATCH // N


def reference(steps=STEPS, lr=LR):
    """One process, whole batch, plain SGD on mean squared error (NumPy)."""
    w, b = W0.astype(np.float64), B0.astype(np.float64)
    for _ in range(steps):
        err = X @ w + b - Y
        gw = 2 * X.T @ err / err.size
        gb = 2 * err.sum(0) / err.size
        w, b = w - lr * gw, b - lr * gb
    return w, b


def shard(r):
    """Rank r's rows of the batch."""
    return slice(r * BATCH // N, (r + 1) * BATCH // N)


def local_grads(r, w=W0, b=B0):
    """NumPy: rank r's gradients (w, b) of the mean squared error on its own rows."""
    x, y = X[shard(r)].astype(np.float64), Y[shard(r)].astype(np.float64)
    err = x @ w + b - y
    return 2 * x.T @ err / err.size, 2 * err.sum(0) / err.size


def shard_loss(r, w=W0, b=B0):
    """NumPy: rank r's mean squared error on its own rows."""
    return float(np.mean((X[shard(r)] @ w + b - Y[shard(r)]) ** 2))


def over_ranks(f):
    """NumPy: the mean over every rank r of f(r), each computed from rank r's known inputs."""
    return np.mean([f(r) for r in range(N)], axis=0)


def assert_same_on_every_rank(value, rtol=1e-6):
    """Compare with every rank's value, gathered by mpi4py (not by horolite)."""
    for other in COMM.allgather(np.asarray(value)):
        np.testing.assert_allclose(other, value, rtol=rtol)


def loss_fn(w, b, x, y):
    return tf.reduce_mean(tf.square(tf.matmul(x, w) + b - y))


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_tape_data_parallel_equivalence(mode):
    w, b = tf.Variable(W0), tf.Variable(B0)
    x, y = tf.constant(X[LO:HI]), tf.constant(Y[LO:HI])

    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(w, b, x, y)
        tape = hvd.DistributedGradientTape(tape)
        gw, gb = tape.gradient(loss, [w, b])
        w.assign_sub(LR * gw)
        b.assign_sub(LR * gb)
        return loss

    step = tf.function(step) if mode == "function" else step
    for _ in range(STEPS):
        step()
    ref_w, ref_b = reference()
    np.testing.assert_allclose(w.numpy(), ref_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b.numpy(), ref_b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_large_gradients_read_where_they_lie_are_right(mode):
    # A step's gradients of 4 MiB or more reach the shared-memory allreduce as the NumPy
    # views of TensorFlow's buffers, read after the enqueue op returned, while TensorFlow
    # goes on (here: allocating more tensors of the same size, which must never land in
    # a buffer still being read). Every step is checked against NumPy.
    from horolite.api.basics import runtime
    from horolite.api.grouping import IN_PLACE_MIN_BYTES
    rows = IN_PLACE_MIN_BYTES // (4 * 512) + 3  # one variable alone is over the threshold
    coef = [np.random.RandomState(100 + r).uniform(-1, 1, (rows, 512)).astype(np.float32)
            for r in range(N)]
    w0 = np.random.RandomState(7).normal(size=(rows, 512)).astype(np.float32)
    w, v = tf.Variable(w0), tf.Variable(np.ones(300, np.float32))
    c = tf.constant(coef[R])

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(w) * c) + tf.reduce_sum(v * float(R + 1))
        gw, gv = hvd.DistributedGradientTape(tape).gradient(loss, [w, v])
        noise = [tf.square(c) + float(i) for i in range(4)]  # fresh buffers of that size
        w.assign_sub(0.01 * gw)
        v.assign_sub(0.01 * gv)
        return tf.add_n([tf.reduce_sum(n) for n in noise])

    step = tf.function(step) if mode == "function" else step
    ref = w0.astype(np.float64)
    for _ in range(3):
        step()
        ref = ref - 0.01 * np.mean([2 * ref * coef[r] for r in range(N)], axis=0)
        np.testing.assert_allclose(w.numpy(), ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(v.numpy(), 1 - 0.03 * (N + 1) / 2, rtol=1e-5)
    shm = runtime().transport.shared_memory
    if shm is not None:
        assert shm.last_mode == "direct", shm.last_mode  # read where they lie, not packed


def test_tape_none_local_groups_and_predivide():
    w, b, unused = tf.Variable(W0), tf.Variable(B0), tf.Variable(1.0)
    local = tf.Variable(float(R))
    x, y = tf.constant(X[LO:HI]), tf.constant(Y[LO:HI])
    with tf.GradientTape(persistent=True) as t:
        loss = loss_fn(w, b, x, y) + local * local
    expect = over_ranks(lambda r: local_grads(r)[0])
    for kwargs in [{}, {"num_groups": 0}, {"num_groups": 1}, {"groups": [[w, b]]},
                   {"gradient_predivide_factor": 2.0},
                   {"compression": hvd.Compression.fp16}]:
        tape = hvd.DistributedGradientTape(t, **kwargs)
        tape.register_local_source(local)
        gw, gb, gu, gl = tape.gradient(loss, [w, b, unused, local])
        assert gu is None
        np.testing.assert_allclose(gl.numpy(), 2.0 * R / N)  # local: not reduced, scaled
        np.testing.assert_allclose(gw.numpy(), expect, rtol=2e-3 if kwargs.get("compression") else 1e-5,
                                   atol=1e-3 if kwargs.get("compression") else 1e-6)
    # Nested sources keep their structure.
    grads = hvd.DistributedGradientTape(t).gradient(loss, {"w": w, "b": b})
    assert set(grads) == {"w", "b"}
    np.testing.assert_allclose(grads["w"].numpy(), expect, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grads["b"].numpy(), over_ranks(lambda r: local_grads(r)[1]),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kwargs, grouped, single", [({}, 1, 0), ({"num_groups": 0}, 0, 3)])
def test_default_sends_a_steps_gradients_as_one_request(kwargs, grouped, single, monkeypatch):
    # One grouped request per step keeps the background thread at one cycle per step;
    # num_groups=0 is Horovod's one request per gradient.
    import horolite
    from horolite.tensorflow import bridge
    calls = {"grouped": 0, "single": 0}
    # (the bridge submits groups through the borrowing form: packing is its only copy)
    real_grouped, real_single = bridge._grouped_allreduce_async, horolite.allreduce_async

    def count(kind, real):
        def wrapper(*args, **kw):
            calls[kind] += 1
            return real(*args, **kw)
        return wrapper
    monkeypatch.setattr(bridge, "_grouped_allreduce_async", count("grouped", real_grouped))
    monkeypatch.setattr(horolite, "allreduce_async", count("single", real_single))
    w, b, c = tf.Variable(W0), tf.Variable(B0), tf.Variable(2.0)
    x, y = tf.constant(X[LO:HI]), tf.constant(Y[LO:HI])
    with tf.GradientTape() as t:
        loss = loss_fn(w, b, x, y) * c
    gw, gb, gc = hvd.DistributedGradientTape(t, **kwargs).gradient(loss, [w, b, c])
    assert calls == {"grouped": grouped, "single": single}
    np.testing.assert_allclose(gc.numpy(), over_ranks(shard_loss), rtol=1e-5)


@pytest.mark.parametrize("case", ["default", "one_variable", "mixed_dtypes", "fp16", "two_groups"])
def test_graph_step_request_ops(case):
    # Inside tf.function a step whose gradients make one request submits and waits in
    # one op; several requests keep an enqueue op each and wait ops after all of them.
    w = tf.Variable(W0)
    b = tf.Variable(B0.astype(np.float64) if case == "mixed_dtypes" else B0)
    x, y = tf.constant(X[LO:HI]), tf.constant(Y[LO:HI])
    sources = [w] if case == "one_variable" else [w, b]
    kwargs = {"fp16": {"compression": hvd.Compression.fp16},
              "two_groups": {"num_groups": 2}}.get(case, {})

    def local_loss():
        return tf.reduce_mean(tf.square(tf.matmul(x, w) + tf.cast(b, tf.float32) - y))

    @tf.function
    def grads():
        with tf.GradientTape() as t:
            loss = local_loss()
        return hvd.DistributedGradientTape(t, **kwargs).gradient(loss, sources)

    expect = [over_ranks(lambda r: local_grads(r)[0]), over_ranks(lambda r: local_grads(r)[1])]
    got = [g.numpy() for g in grads()]
    tol = {"rtol": 2e-3, "atol": 1e-3} if case == "fp16" else {"rtol": 1e-5, "atol": 1e-6}
    for g, e, s in zip(got, expect, sources):
        assert g.dtype == s.dtype.as_numpy_dtype and g.shape == tuple(s.shape)
        np.testing.assert_allclose(g, e, **tol)
    ops = grads.get_concrete_function().graph.get_operations()
    names = [op.name for op in ops
             if op.type in ("PyFunc", "EagerPyFunc", "HorolitAsyncWait", "HorolitEnqueue")]
    if NATIVE:  # no Python op at all: the native enqueue and wait ops
        assert not [op for op in ops if op.type in ("PyFunc", "EagerPyFunc")], names
    if case == "two_groups" or NATIVE:
        # (with the native wait op, a wait holds no thread: always an enqueue and a wait)
        groups = 2 if case == "two_groups" else 1
        assert sum("HorolitEnqueue" in n for n in names) == groups, names
        assert sum("HorolitWait" in n for n in names) == groups, names
    else:
        assert len(names) == 1 and "HorolitCollective" in names[0], names


@pytest.mark.skipif(N < 2, reason="a mismatch needs two ranks")
@pytest.mark.parametrize("sources", [1, 2])
def test_graph_step_mismatch_names_the_gradient_then_works(sources):
    # The one-op exchange of a tf.function step: a gradient whose shape differs on one
    # rank fails on every rank, naming it and the shapes; the next step works.
    odd = tf.Variable(tf.ones((3,) if R == 0 else (4,)), name="odd_one")
    extra = [tf.Variable(tf.ones(2), name="fine")] if sources == 2 else []

    @tf.function
    def grads():
        with tf.GradientTape() as t:
            loss = tf.add_n([tf.reduce_sum(v * v) for v in [odd, *extra]])
        return hvd.DistributedGradientTape(t).gradient(loss, [odd, *extra])

    with pytest.raises(tf.errors.FailedPreconditionError if NATIVE else tf.errors.InvalidArgumentError,
                       match="odd_one") as info:
        grads()
    message = str(info.value)
    assert "(3,)" in message and "(4,)" in message, message
    w = tf.Variable(tf.fill([3], float(R + 1)))

    @tf.function
    def good():
        with tf.GradientTape() as t:
            loss = tf.reduce_sum(w * w)
        return hvd.DistributedGradientTape(t).gradient(loss, [w])[0]

    np.testing.assert_allclose(good().numpy(), np.full(3, 2.0 * np.mean(np.arange(1, N + 1))))


def test_constructor_errors():
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        hvd.DistributedGradientTape(tf.GradientTape(), op=hvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), op=hvd.Sum,
                                 gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        hvd.DistributedGradientTape(tf.GradientTape(), op=hvd.Adasum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), backward_passes_per_step=0)


def test_tape_refuses_sources_that_are_not_variables():
    x = tf.constant(2.0)
    with pytest.raises(ValueError, match="register_local_source: expected a variable .* got EagerTensor"):
        hvd.DistributedGradientTape(tf.GradientTape()).register_local_source(x)
    with tf.GradientTape() as t:
        t.watch(x)
        y = x * x
    with pytest.raises(ValueError, match="backward_passes_per_step > 1 needs variable sources"):
        hvd.DistributedGradientTape(t, backward_passes_per_step=2).gradient(y, [x])


def embedding_setup():
    table = tf.Variable(np.arange(12, dtype=np.float32).reshape(6, 2))
    ids = tf.constant([R % 6, (R + 2) % 6], tf.int64)
    return table, ids


@pytest.mark.parametrize("sparse_as_dense", [False, True])
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_sparse_gradients(sparse_as_dense, mode):
    table, ids = embedding_setup()

    def grad():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.nn.embedding_lookup(table, ids)) * float(R + 1)
        tape = hvd.DistributedGradientTape(tape, sparse_as_dense=sparse_as_dense)
        g = tape.gradient(loss, [table])[0]
        if not sparse_as_dense:
            assert isinstance(g, tf.IndexedSlices)
        return tf.convert_to_tensor(g)

    g = (tf.function(grad) if mode == "function" else grad)().numpy()
    expect = np.zeros((6, 2))
    for r in range(N):
        for i in (r % 6, (r + 2) % 6):
            expect[i] += (r + 1.0) / N
    np.testing.assert_allclose(g, expect, rtol=1e-6)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.nn.embedding_lookup(table, ids))
    with pytest.raises(NotImplementedError, match="IndexedSlices"):
        hvd.DistributedGradientTape(tape, op=hvd.Max).gradient(loss, [table])


def sgd_graph_training(passes, average, steps):
    """TF1 graph: returns the weights after every session step."""
    with tf.Graph().as_default():
        w = tf.compat.v1.get_variable("w", initializer=W0)
        b = tf.compat.v1.get_variable("b", initializer=B0)
        x = tf.compat.v1.placeholder(tf.float32, [None, 4])
        y = tf.compat.v1.placeholder(tf.float32, [None, 2])
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LR),
                                       backward_passes_per_step=passes,
                                       average_aggregated_gradients=average)
        step = tf.compat.v1.train.get_or_create_global_step()
        train = opt.minimize(loss_fn(w, b, x, y), global_step=step)
        history = []
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for i in range(steps):
                sl = slice(LO, HI) if passes == 1 else minibatch(i)
                sess.run(train, {x: X[sl], y: Y[sl]})
                history.append((sess.run(w), sess.run(step)))
    return history


def minibatch(i):
    """Pass i of 4 on this rank: a quarter of this rank's rows (BATCH/N rows, in 4 parts)."""
    rows = np.arange(LO, HI)
    return rows[i % 4::4] if len(rows) >= 4 else rows


def test_legacy_optimizer_graph_equivalence():
    history = sgd_graph_training(1, False, STEPS)
    np.testing.assert_allclose(history[-1][0], reference()[0], rtol=1e-5, atol=1e-6)
    assert history[-1][1] == STEPS


def test_legacy_optimizer_eager_equivalence():
    w, b = tf.Variable(W0), tf.Variable(B0)
    opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LR))
    x, y = tf.constant(X[LO:HI]), tf.constant(Y[LO:HI])
    for _ in range(STEPS):
        opt.minimize(lambda: loss_fn(w, b, x, y), var_list=[w, b])
    np.testing.assert_allclose(w.numpy(), reference()[0], rtol=1e-5, atol=1e-6)


def local_grad_sum(passes):
    """NumPy: the sum over ranks and passes of the local gradient at W0 (w unchanged in between)."""
    total = np.zeros_like(W0, dtype=np.float64)
    for r in range(N):
        rows = np.arange(r * BATCH // N, (r + 1) * BATCH // N)
        for i in range(passes):
            sl = rows[i % 4::4] if len(rows) >= 4 else rows
            err = X[sl] @ W0 + B0 - Y[sl]
            total += 2 * X[sl].T @ err / err.size
    return total


@pytest.mark.parametrize("average", [False, True])
def test_local_aggregation_graph(average):
    history = sgd_graph_training(4, average, 8)
    for i in range(3):  # variables unchanged until the 4th call
        np.testing.assert_array_equal(history[i][0], W0)
    total = local_grad_sum(4) / N  # op=Average over ranks
    if average:
        total /= 4
    np.testing.assert_allclose(history[3][0], W0 - LR * total, rtol=1e-5, atol=1e-6)
    for i in range(4, 7):
        np.testing.assert_array_equal(history[i][0], history[3][0])
    assert not np.allclose(history[7][0], history[3][0])
    assert [h[1] for h in history] == [0, 0, 0, 1, 1, 1, 1, 2]  # global_step: applied steps


def four_aggregated_passes(loss_of, w, b, mode):
    """SGD on (w, b) through a tape with backward_passes_per_step=4 and Sum, over this
    rank's 4 minibatches: only the 4th call communicates (and changes w, from W0)."""
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_of(x, y)
        tape = hvd.DistributedGradientTape(tape, backward_passes_per_step=4, op=hvd.Sum)
        gw, gb = tape.gradient(loss, [w, b])
        w.assign_sub(LR * gw)  # zeros on the calls that do not communicate
        b.assign_sub(LR * gb)
        return tape.gradients_ready

    step = tf.function(step) if mode == "function" else step
    for i in range(4):
        ready = step(tf.constant(X[minibatch(i)]), tf.constant(Y[minibatch(i)]))
        assert bool(ready) == (i == 3)
        if i < 3:
            np.testing.assert_array_equal(w.numpy(), W0)


@pytest.mark.skipif(N < 2, reason="a mismatch needs two ranks")  # (one rank cannot fail so)
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_local_aggregation_goes_on_after_an_exchange_failed_on_every_rank(mode):
    """The 4th pass's exchange fails on every rank (rank 1 compresses to float16, the others
    do not: a dtype mismatch). Its group's sums are dropped, and the next 4 passes exchange
    and apply as if the failed group had never run. (Before, the counter went past 4 and
    no later pass ever exchanged again: training went on, silently never updating.)"""
    w, b = tf.Variable(W0), tf.Variable(B0)

    def step(x, y, fp16):
        with tf.GradientTape() as tape:
            loss = loss_fn(w, b, x, y)
        tape = hvd.DistributedGradientTape(
            tape, backward_passes_per_step=4, op=hvd.Sum,
            compression=hvd.Compression.fp16 if fp16 else hvd.Compression.none)
        gw, gb = tape.gradient(loss, [w, b])
        w.assign_sub(LR * gw)
        b.assign_sub(LR * gb)
        return tape.gradients_ready

    step = tf.function(step) if mode == "function" else step  # (fp16: a trace each way)
    xs = [tf.constant(X[minibatch(i)]) for i in range(4)]
    ys = [tf.constant(Y[minibatch(i)]) for i in range(4)]
    for i in range(3):
        step(xs[i], ys[i], False)
    error = (tf.errors.FailedPreconditionError if mode == "eager" or NATIVE
             else tf.errors.InvalidArgumentError)
    with pytest.raises(error, match="float16"):
        step(xs[3], ys[3], R == 1)
    np.testing.assert_array_equal(w.numpy(), W0)
    for i in range(4):
        assert bool(step(xs[i], ys[i], False)) == (i == 3)
    np.testing.assert_allclose(w.numpy(), W0 - LR * local_grad_sum(4), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_local_aggregation_tape_and_eager_optimizer(mode):
    w, b = tf.Variable(W0), tf.Variable(B0)
    four_aggregated_passes(lambda x, y: loss_fn(w, b, x, y), w, b, mode)
    np.testing.assert_allclose(w.numpy(), W0 - LR * local_grad_sum(4), rtol=1e-5, atol=1e-6)

    # The legacy optimizer eagerly (Horovod refuses this; horolite supports it).
    w.assign(W0)
    b.assign(B0)
    opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LR),
                                   backward_passes_per_step=4, average_aggregated_gradients=True)
    for i in range(4):
        x, y = tf.constant(X[minibatch(i)]), tf.constant(Y[minibatch(i)])
        pairs = opt.compute_gradients(lambda: loss_fn(w, b, x, y), var_list=[w, b])
        if i < 3:
            np.testing.assert_array_equal(pairs[0][0].numpy(), np.zeros_like(W0))
        opt.apply_gradients(pairs)
        if i < 3:
            np.testing.assert_array_equal(w.numpy(), W0)
    np.testing.assert_allclose(w.numpy(), W0 - LR * local_grad_sum(4) / N / 4, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ Keras 3 ----
import horolite.tensorflow.keras as hvdk  # noqa: E402

keras = tf.keras


def keras_model(kernel=W0, bias=B0):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.layers[0].set_weights([kernel, bias])
    return model


class Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.losses, self.lrs = [], []

    def on_train_batch_begin(self, batch, logs=None):
        self.lrs.append(float(self.model.optimizer.learning_rate.numpy()))

    def on_epoch_end(self, epoch, logs=None):
        self.losses.append(logs["loss"])


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_tape_options_take_keras_variables(mode, monkeypatch):
    # Keras 3 variables are not tf.Variables (no .ref(), unhashable): groups,
    # register_local_source and local aggregation must still know them.
    model = keras_model()
    kernel, bias = model.layers[0].kernel, model.layers[0].bias
    local = keras.Variable(float(R), name="local")
    x, y = tf.constant(X[LO:HI]), tf.constant(Y[LO:HI])
    expect = over_ranks(lambda r: local_grads(r)[0])

    for kwargs in [{}, {"groups": [[kernel, bias]]}, {"groups": [[bias], [kernel]]}]:
        def grads():
            with tf.GradientTape() as t:
                loss = tf.reduce_mean(tf.square(model(x) - y)) + local * local
            tape = hvd.DistributedGradientTape(t, **kwargs)
            tape.register_local_source(local)
            return tape.gradient(loss, [kernel, bias, local])

        if mode == "eager":  # the groups are kept: one request per group
            import horolite
            from horolite.tensorflow import bridge
            requests = []
            grouped, single = bridge._grouped_allreduce_async, horolite.allreduce_async
            monkeypatch.setattr(bridge, "_grouped_allreduce_async",
                                lambda arrays, *a, **kw: requests.append(len(arrays)) or grouped(arrays, *a, **kw))
            monkeypatch.setattr(horolite, "allreduce_async",
                                lambda *a, **kw: requests.append(1) or single(*a, **kw))
        gk, gb, gl = (tf.function(grads) if mode == "function" else grads)()
        if mode == "eager":
            monkeypatch.undo()
            assert sorted(requests) == sorted(len(g) for g in kwargs.get("groups", [[kernel, bias]]))
        np.testing.assert_allclose(gk.numpy(), expect, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(gl.numpy(), 2.0 * R / N)  # local: not reduced, scaled
    with pytest.raises(ValueError, match="groups"):
        hvd.DistributedGradientTape(tf.GradientTape(), groups=[[kernel, "not a variable"]])

    four_aggregated_passes(lambda x, y: tf.reduce_mean(tf.square(model(x) - y)), kernel, bias, mode)
    np.testing.assert_allclose(kernel.numpy(), W0 - LR * local_grad_sum(4), rtol=1e-5, atol=1e-6)


def test_keras_module_has_horovods_names():
    # horovod.tensorflow.keras's functions, so `import horolite.tensorflow.keras as hvd` is enough
    assert hvdk.size() == N and hvdk.is_homogeneous() in (True, False)
    without_mpi = "HOROLITE_RANK" in os.environ  # (horolite-run --gloo)
    assert hvdk.mpi_built() and hvdk.gloo_built()
    assert hvdk.mpi_enabled() != without_mpi and hvdk.gloo_enabled() == without_mpi
    rows = np.arange(N * 2, dtype=np.float32).reshape(N * 2, 1) + R
    mine = hvdk.reducescatter(tf.constant(rows), op=hvdk.Sum).numpy()
    total = sum(np.arange(N * 2, dtype=np.float32).reshape(N * 2, 1) + r for r in range(N))
    np.testing.assert_allclose(mine, total[2 * R:2 * R + 2])


def test_keras_fit_equivalence_and_callbacks():
    # Differently initialised ranks: the broadcast callback makes them equal to rank 0 (W0).
    model = keras_model(W0 + R, B0 + R)
    opt = hvdk.DistributedOptimizer(keras.optimizers.SGD(LR))
    assert isinstance(opt, keras.optimizers.SGD)
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    rec = Recorder()
    model.fit(X[LO:HI], Y[LO:HI], batch_size=HI - LO, epochs=STEPS, shuffle=False, verbose=0,
              callbacks=[hvdk.callbacks.BroadcastGlobalVariablesCallback(0),
                         hvdk.callbacks.MetricAverageCallback(), rec])
    ref_w, ref_b = reference()
    kernel, bias = model.layers[0].get_weights()
    np.testing.assert_allclose(kernel, ref_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bias, ref_b, rtol=1e-5, atol=1e-6)
    # Metric averaging: every rank logs the same (averaged) loss.
    assert len(rec.losses) == STEPS
    assert_same_on_every_rank(rec.losses)


@pytest.mark.parametrize("staircase", [True, False])
def test_keras_learning_rate_schedule(staircase):
    # Horovod's schedule: initial_lr * multiplier(epoch) inside [start_epoch, end_epoch), per
    # epoch (staircase) or per batch with the epoch fractional; untouched outside.
    model = keras_model()
    model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse",
                  jit_compile=False)
    rec = Recorder()
    batch_size = max(1, (HI - LO) // 2)
    steps = -(-(HI - LO) // batch_size)
    sched = hvdk.callbacks.LearningRateScheduleCallback(0.4, lambda e: 0.5 ** e, start_epoch=1,
                                                        end_epoch=3, staircase=staircase)
    const = hvdk.callbacks.LearningRateScheduleCallback(0.4, 0.25, start_epoch=3)
    history = model.fit(X[LO:HI], Y[LO:HI], batch_size=batch_size, epochs=5,
                        verbose=0, callbacks=[sched, const, rec])
    expect = []
    for epoch in range(5):
        for batch in range(steps):
            e = epoch if staircase else epoch + batch / steps
            if epoch == 0:
                expect.append(0.05)
            elif epoch < 3:
                expect.append(0.4 * 0.5 ** e)
            else:  # a constant multiplier decays exponentially from start_epoch, as Horovod's
                expect.append(0.4 * 0.25 ** (epoch - 3))
    np.testing.assert_allclose(rec.lrs, expect, rtol=1e-6)
    np.testing.assert_allclose(history.history["lr"], [expect[k * steps + steps - 1] for k in range(5)],
                               rtol=1e-6)


def test_keras_save_then_load_model_resumes(tmp_path):
    # A model saved with a DistributedOptimizer loads in plain Keras (as the optimizer it
    # wrapped), and hvd.load_model wraps it again with its state (momentum, iterations).
    def fit(model, epochs):
        model.fit(X[LO:HI], Y[LO:HI], batch_size=max(1, (HI - LO) // 2), epochs=epochs,
                  shuffle=False, verbose=0)

    model = keras_model()
    model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=0.9)),
                  loss="mse", jit_compile=False)
    fit(model, 1)
    path = str(tmp_path / "model.keras")
    model.save(path)
    plain = keras.models.load_model(path)
    assert type(plain.optimizer) is keras.optimizers.SGD
    loaded = hvdk.load_model(path)
    assert isinstance(loaded.optimizer, keras.optimizers.SGD)
    assert hasattr(loaded.optimizer, "_horolite_reducer")
    assert int(loaded.optimizer.iterations.numpy()) == int(model.optimizer.iterations.numpy()) > 0
    fit(model, 2)
    fit(loaded, 2)
    for a, b in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    # ... and every rank trained the same model (the gradients were averaged)
    assert_same_on_every_rank(loaded.layers[0].get_weights()[0])


def test_keras_local_aggregation_and_warmup():
    model = keras_model()
    opt = hvdk.DistributedOptimizer(keras.optimizers.SGD(LR), backward_passes_per_step=4,
                                    average_aggregated_gradients=True)
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    seen = []

    class Watch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(model.layers[0].get_weights()[0].copy())

    batches = tf.data.Dataset.from_generator(
        lambda: ((X[minibatch(i)], Y[minibatch(i)]) for i in range(4)),
        output_signature=(tf.TensorSpec([None, 4], tf.float32), tf.TensorSpec([None, 2], tf.float32)))
    model.fit(batches, epochs=1, verbose=0, callbacks=[Watch()])
    for i in range(3):
        np.testing.assert_array_equal(seen[i], W0)
    np.testing.assert_allclose(seen[3], W0 - LR * local_grad_sum(4) / N / 4, rtol=1e-5, atol=1e-6)
    assert int(opt.iterations.numpy()) == 4

    model = keras_model()
    model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.4)), loss="mse",
                  jit_compile=False)
    rec = Recorder()
    warm = hvdk.callbacks.LearningRateWarmupCallback(0.4, warmup_epochs=2, steps_per_epoch=2)
    model.fit(X[LO:HI], Y[LO:HI], batch_size=max(1, (HI - LO) // 2), epochs=3, verbose=0,
              callbacks=[warm, rec])
    # Horovod's: lr = 0.4 / N * (e * (N - 1) / 2 + 1), e = epoch + (batch + 1) / steps_per_epoch,
    # during the 2 warmup epochs; then the rate stays where the warmup left it
    steps = -(-(HI - LO) // max(1, (HI - LO) // 2))
    expect = [0.4 / N * ((ep + (b + 1) / 2) * (N - 1) / 2 + 1) for ep in range(2) for b in range(steps)]
    expect += [expect[-1]] * steps
    np.testing.assert_allclose(rec.lrs, expect, rtol=1e-6)
    if steps == 2:
        assert abs(expect[-1] - 0.4) < 1e-9


def two_layer_model():
    """A shared Dense(2) (W0, B0 on every rank) feeding a rank-local Dense(1) head."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    model.layers[0].set_weights([W0, B0])
    model.layers[1].set_weights([np.full((2, 1), R + 1.0, np.float32), np.full(1, -R, np.float32)])
    return model


def two_layer_grads(r):
    """NumPy: rank r's gradients (shared kernel, shared bias, head kernel, head bias) of
    two_layer_loss, with rank r's own head (R + 1, -R)."""
    x, y = X[shard(r)].astype(np.float64), Y[shard(r), :1].astype(np.float64)
    head_w, head_b = np.full((2, 1), r + 1.0), np.full(1, -float(r))
    hidden = x @ W0 + B0
    d_out = 2 * (hidden @ head_w + head_b - y) / y.size
    d_hidden = d_out @ head_w.T
    return [x.T @ d_hidden, d_hidden.sum(0), hidden.T @ d_out, d_out.sum(0)]


def two_layer_loss(model):
    return tf.reduce_mean(tf.square(model(tf.constant(X[LO:HI])) - Y[LO:HI, :1]))


@pytest.mark.parametrize("scale", [True, False])
@pytest.mark.parametrize("api", ["tape", "partial_tape", "keras_optimizer", "partial_keras_optimizer"])
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_model_parallel_local_layers(api, scale, mode):
    # The shared layer's gradients are averaged; the local head's stay this rank's own,
    # divided by size() unless scale_local_gradients=False (Horovod's default scales).
    model = two_layer_model()
    shared, head = model.layers
    mine = two_layer_grads(R)
    expect = [over_ranks(lambda r: two_layer_grads(r)[i]) for i in range(2)]
    expect += [g / N if scale else g for g in mine[2:]]

    if api in ("tape", "partial_tape"):
        def grads():
            with tf.GradientTape() as t:
                loss = two_layer_loss(model)
            if api == "tape":
                tape = hvd.DistributedGradientTape(t, scale_local_gradients=scale)
                for v in head.trainable_variables:
                    tape.register_local_source(v)
            else:
                tape = hvd.PartialDistributedGradientTape(t, local_layers=head,
                                                          scale_local_gradients=scale)
            return tape.gradient(loss, model.trainable_variables)
        got = (tf.function(grads) if mode == "function" else grads)()
        for g, e in zip(got, expect):
            np.testing.assert_allclose(g.numpy(), e, rtol=1e-5, atol=1e-6)
        return

    if api == "keras_optimizer":
        opt = hvdk.DistributedOptimizer(keras.optimizers.SGD(LR), scale_local_gradients=scale)
        for v in head.trainable_variables:
            opt.register_local_var(v)
    else:
        opt = hvdk.PartialDistributedOptimizer(keras.optimizers.SGD(LR), local_layers=[head],
                                               scale_local_gradients=scale)
    before = [v.numpy() for v in model.trainable_variables]

    def step():
        with tf.GradientTape() as t:
            loss = two_layer_loss(model)
        opt.apply(t.gradient(loss, model.trainable_variables), model.trainable_variables)

    (tf.function(step) if mode == "function" else step)()
    for v, b, e in zip(model.trainable_variables, before, expect):
        np.testing.assert_allclose(v.numpy(), b - LR * e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("passes", [1, 4])
def test_legacy_optimizer_local_vars(passes):
    # register_local_var on the TF1 optimizer, alone and with local aggregation (Sum of
    # 4 passes): the local variable's update is its own gradient sum / size().
    w, b, local = tf.Variable(W0), tf.Variable(B0), tf.Variable(float(R + 1))
    opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LR),
                                   backward_passes_per_step=passes)
    opt.register_local_var(local)
    for i in range(passes):
        sl = slice(LO, HI) if passes == 1 else minibatch(i)
        x, y = tf.constant(X[sl]), tf.constant(Y[sl])
        pairs = opt.compute_gradients(lambda: loss_fn(w, b, x, y) + local * local,
                                      var_list=[w, b, local])
        opt.apply_gradients(pairs)
    if passes > 1:
        grad_w = local_grad_sum(passes) / N
    else:
        grad_w = over_ranks(lambda r: local_grads(r)[0])
    np.testing.assert_allclose(w.numpy(), W0 - LR * grad_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(local.numpy(), (R + 1) - LR * passes * 2.0 * (R + 1) / N, rtol=1e-6)


def test_local_layers_must_be_layers():
    with pytest.raises(ValueError, match="PartialDistributedGradientTape: local_layers must be Keras "
                                         "layers, got ResourceVariable"):
        hvd.PartialDistributedGradientTape(tf.GradientTape(), local_layers=[tf.Variable(1.0)])
    with pytest.raises(ValueError, match="register_local_var: expected a variable .* got str"):
        hvdk.DistributedOptimizer(keras.optimizers.SGD(LR)).register_local_var("bias")


def test_an_elastic_sync_builds_an_optimizer_that_never_stepped_and_gets_rank_0s_slots():
    # A worker that joins holds a Keras 3 optimizer without slots; rank 0's has stepped.
    import keras
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.1))
    if R == 0:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(X[:2]))
        keras.optimizers.Adam.apply(opt, tape.gradient(loss, model.trainable_variables),
                                    model.trainable_variables)
    assert opt.built == (R == 0)
    state = hvd.elastic.TensorFlowKerasState(model, opt, epoch=R)
    state.sync()
    assert opt.built and len(opt.variables) == 2 + 2 * len(model.trainable_variables)
    mine = np.concatenate([np.ravel(v.numpy()) for v in opt.variables])
    assert COMM.allreduce(mine.size, MPI.MAX) == mine.size
    np.testing.assert_array_equal(mine, COMM.bcast(mine, root=0))
    assert int(opt.iterations.numpy()) == 1 and state.epoch == 0


def test_an_elastic_sync_of_different_variable_counts_names_them_on_every_rank():
    if N == 1:
        pytest.skip("one rank cannot disagree")
    state = hvd.elastic.TensorFlowState([tf.Variable(0.0) for _ in range(1 + (R == N - 1))])
    others = "ranks 0, " + ", ".join(map(str, range(1, N - 1))) if N > 2 else "rank 0"
    with pytest.raises(ValueError, match=rf"TensorFlowState 1 on {others.rstrip(', ')} but "
                                         rf"2 on rank {N - 1}"):
        state.sync()
    hvd.elastic.TensorFlowState([tf.Variable(float(R))]).sync()  # (and the job goes on)


def test_an_elastic_sync_starts_every_local_aggregation_group_again():
    # backward_passes_per_step: a worker that joins begins at the group's first pass, so
    # the others drop the passes of the group they were in (every rank alike).
    v = tf.Variable(np.zeros(2, np.float32))

    def one_pass(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(v * x)
        return hvd.DistributedGradientTape(tape, backward_passes_per_step=2).gradient(loss, [v])[0]
    one_pass(np.float32(100 + R))  # half a group: dropped at the sync
    hvd.elastic.TensorFlowState([v]).sync()
    assert not one_pass(np.float32(1)).numpy().any()  # the first pass of a new group
    # the group: the sum of its two passes (1 and R), averaged over the ranks
    np.testing.assert_allclose(one_pass(np.float32(R)).numpy(), [1 + (N - 1) / 2] * 2)
