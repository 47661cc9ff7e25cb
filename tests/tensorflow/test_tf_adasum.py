"""Rank side: Adasum in the TensorFlow API (allreduce, grouped allreduce, the tape, both
DistributedOptimizers), against a NumPy reference of the pairwise formula computed here
from every rank's known inputs. At a count of ranks that is not a power of two, each
of them raises Horovod's NotImplementedError on every rank, naming the count.

Run by tests/test_matrix_tensorflow.py under mpirun -np 1..4.
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import pytest
import tensorflow as tf

import horolite.tensorflow as hvd
import horolite.tensorflow.keras as hvdk
from adasum_reference import tree as adasum_tree
from tf_modes import MODES, run

hvd.init()
R, N = hvd.rank(), hvd.size()
POW2 = N & (N - 1) == 0
TOL = {tf.float16: dict(rtol=5e-3, atol=5e-3), tf.float32: dict(rtol=1e-5, atol=1e-6),
       tf.float64: dict(rtol=1e-12, atol=1e-12)}
LR = 0.125  # exact in float32 too (the legacy optimizers keep the rate in float32)


def tree(vectors, shape):
    return np.asarray(adasum_tree(vectors)).reshape(shape)


def rank_input(r, shape, seed=0):
    return np.random.RandomState(1000 * seed + r).normal(size=shape)


def refused(call):
    """At a count that is not a power of two: Horovod's class, naming the count."""
    with pytest.raises(NotImplementedError, match=f"non-power of 2 ranks.*this job has {N} ranks"):
        call()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [tf.float16, tf.float32, tf.float64])
def test_allreduce(mode, dtype):
    shape = (3, 5)
    everyone = [rank_input(r, shape, 1).astype(dtype.as_numpy_dtype) for r in range(N)]
    fn = lambda t: hvd.allreduce(t, op=hvd.Adasum)  # noqa: E731
    if not POW2:
        refused(lambda: run(mode, fn, everyone[R]))
        return
    got = run(mode, fn, everyone[R])
    assert got.dtype == dtype.as_numpy_dtype
    np.testing.assert_allclose(got.astype(np.float64), tree(everyone, shape), **TOL[dtype])


@pytest.mark.parametrize("mode", MODES)
def test_grouped_allreduce_keeps_each_tensors_coefficients(mode):
    shapes = [(4,), (2, 3)]
    everyone = [[rank_input(r, s, 2 + i) * 10.0 ** (r * i) for r in range(N)]
                for i, s in enumerate(shapes)]
    fn = lambda a, b: hvd.grouped_allreduce([a, b], op=hvd.Adasum)  # noqa: E731
    if not POW2:
        refused(lambda: run(mode, fn, everyone[0][R], everyone[1][R]))
        return
    got = run(mode, fn, everyone[0][R], everyone[1][R])
    for g, e, s in zip(got, everyone, shapes):
        np.testing.assert_allclose(g, tree(e, s), rtol=1e-12)
    if N > 1:  # one set of coefficients for both would give another answer
        whole = tree([np.concatenate([everyone[0][r], everyone[1][r].ravel()]) for r in range(N)],
                     (10,))
        assert not np.allclose(whole[:4], tree(everyone[0], (4,)), rtol=1e-3)


def linear_problem(r, batch=0):
    """Rank r's `batch` of a linear least-squares problem (gradients differ by rank and batch)."""
    rng = np.random.RandomState(50 + r + 1000 * batch)
    return rng.normal(size=(6, 3)), rng.normal(size=(6, 1))


W0 = np.random.RandomState(7).normal(size=(3, 1))


def grad_of(w, r, batch=0):
    x, y = linear_problem(r, batch)
    return 2 * x.T @ (x @ w - y) / len(y)


def loss(w, r, batch=0):
    x, y = linear_problem(r, batch)
    return tf.reduce_mean(tf.square(tf.matmul(tf.constant(x), w) - tf.constant(y)))


def test_gradient_tape_reduces_the_gradients_with_adasum():
    w = tf.Variable(W0)
    if not POW2:
        refused(lambda: hvd.DistributedGradientTape(tf.GradientTape(), op=hvd.Adasum))
        return
    with tf.GradientTape() as tape:
        value = loss(w, R)
    (g,) = hvd.DistributedGradientTape(tape, op=hvd.Adasum).gradient(value, [w])
    np.testing.assert_allclose(g.numpy(), tree([grad_of(W0, r) for r in range(N)], W0.shape),
                               rtol=1e-10)


def test_gradient_tape_with_backward_passes_sums_locally_then_adasum():
    if not POW2:
        refused(lambda: hvd.DistributedGradientTape(tf.GradientTape(), op=hvd.Adasum,
                                                    backward_passes_per_step=2))
        return
    w = tf.Variable(W0)
    got = []
    for batch in range(2):  # a batch per pass: the second call reduces the two's sum
        with tf.GradientTape() as tape:
            value = loss(w, R, batch)
        tape = hvd.DistributedGradientTape(tape, op=hvd.Adasum, backward_passes_per_step=2)
        got.append((tape.gradient(value, [w])[0].numpy(), tape.gradients_ready))
    assert [ready for _, ready in got] == [False, True]
    summed = [grad_of(W0, r, 0) + grad_of(W0, r, 1) for r in range(N)]
    np.testing.assert_allclose(got[1][0], tree(summed, W0.shape), rtol=1e-10)
    if N > 1:  # Adasum of each pass, then their sum, would give another answer
        each = sum(tree([grad_of(W0, r, b) for r in range(N)], W0.shape) for b in range(2))
        assert not np.allclose(each, tree(summed, W0.shape), rtol=1e-3)


def test_keras_optimizer_applies_the_adasum_of_the_gradients():
    if not POW2:
        refused(lambda: hvdk.DistributedOptimizer(tf.keras.optimizers.SGD(LR), op=hvd.Adasum))
        return
    w = tf.Variable(W0)
    opt = hvdk.DistributedOptimizer(tf.keras.optimizers.SGD(LR), op=hvd.Adasum)
    with tf.GradientTape() as tape:
        value = loss(w, R)
    opt.apply_gradients(zip(tape.gradient(value, [w]), [w]))
    expect = W0 - LR * tree([grad_of(W0, r) for r in range(N)], W0.shape)
    np.testing.assert_allclose(w.numpy(), expect, rtol=1e-6, atol=1e-7)


def delta_reference(steps, passes):
    """Horovod's delta optimizer with plain SGD: each rank steps locally; every `passes`-th
    step the changes since the last exchange are combined with Adasum."""
    start = W0.copy()
    ws = [W0.copy() for _ in range(N)]
    for step in range(steps):
        ws = [w - LR * grad_of(w, r) for r, w in enumerate(ws)]
        if step % passes == passes - 1:
            start = start + tree([w - start for w in ws], W0.shape)
            ws = [start.copy() for _ in range(N)]
    return ws[R]


@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_legacy_optimizer_reduces_the_change_of_the_weights(mode, passes):
    steps = 4
    make = lambda: hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LR),  # noqa: E731
                                            op=hvd.Adasum, backward_passes_per_step=passes)
    if not POW2:
        refused(make)
        return
    if mode == "eager":
        w = tf.Variable(W0)
        opt = make()
        for _ in range(steps):
            opt.minimize(lambda: loss(w, R), var_list=[w])
        got = w.numpy()
    else:
        with tf.Graph().as_default():
            w = tf.compat.v1.Variable(W0)
            train = make().minimize(loss(w, R), var_list=[w])
            with tf.compat.v1.Session() as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                for _ in range(steps):
                    sess.run(train)
                got = sess.run(w)
    np.testing.assert_allclose(got, delta_reference(steps, passes), rtol=1e-10, atol=1e-12)


def test_horovods_refusals():
    with pytest.raises(ValueError, match="op == Adasum is not supported yet with Keras"):
        hvd.DistributedOptimizer(tf.keras.optimizers.SGD(LR), op=hvd.Adasum)
    with pytest.raises(ValueError, match="Adasum does not support average_aggregated_gradients"):
        hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LR), op=hvd.Adasum,
                                 backward_passes_per_step=2, average_aggregated_gradients=True)
    sparse = tf.IndexedSlices(tf.ones((1, 2)), tf.constant([0]), tf.constant([3, 2]))
    with pytest.raises(NotImplementedError, match="Adasum reduction does not currently support sparse"):
        hvd.allreduce(sparse, op=hvd.Adasum)
    # and the runtime goes on
    np.testing.assert_allclose(hvd.allreduce(tf.constant([1.0]), op=hvd.Sum).numpy(), [float(N)])
