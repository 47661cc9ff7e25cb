"""Rank side: process sets in the TensorFlow API. Even ranks train model A, odd ranks
model B, at the same time, each set's result equal to one process training on that
set's whole batch; the collectives with process_set=; a rank outside the set keeps
its own gradients (as in Horovod).

Run by tests/test_matrix_tensorflow.py under mpirun -np 1..4.
"""
import os
import re

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import pytest
import tensorflow as tf

import horolite.tensorflow as hvd
import horolite.tensorflow.keras as hvdk

_n = int(os.environ.get("PMI_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE",
                                                 os.environ.get("HOROLITE_SIZE", "1"))))
EVEN, ODD = hvd.ProcessSet(range(0, _n, 2)), hvd.ProcessSet(range(1, _n, 2))
hvd.init(process_sets=[s for s in (EVEN, ODD) if s.ranks and s.ranks != list(range(_n))])
R, N = hvd.rank(), hvd.size()
if N == 1:
    EVEN = hvd.global_process_set  # the only set of one rank
MINE, OTHER = (EVEN, ODD) if R % 2 == 0 else (ODD, EVEN)
SR, SN = MINE.rank(), MINE.size()
BATCH, STEPS, LR = 12, 3, 0.1  # a set has 1 or 2 ranks: 12 rows split evenly


def problem(which):
    """Set `which`'s data and starting weights (known on every rank)."""
    rng = np.random.RandomState(10 + which)
    return (rng.normal(size=(BATCH, 4)).astype(np.float32),
            rng.normal(size=(BATCH, 2)).astype(np.float32),
            rng.normal(size=(4, 2)).astype(np.float32))


X, Y, W0 = problem(R % 2)
LO, HI = SR * BATCH // SN, (SR + 1) * BATCH // SN


def reference():
    """One process, the set's whole batch, plain SGD on mean squared error."""
    w, b = W0.astype(np.float64), np.zeros(2)
    for _ in range(STEPS):
        err = X @ w + b - Y
        w, b = w - LR * 2 * X.T @ err / err.size, b - LR * 2 * err.sum(0) / err.size
    return w, b


def loss_fn(w, b, x, y):
    return tf.reduce_mean(tf.square(tf.matmul(x, w) + b - y))


def test_tape_per_set():  # eagerly (the graph path: the legacy optimizer below)
    w, b = tf.Variable(W0), tf.Variable(tf.zeros(2))
    x, y = tf.constant(X[LO:HI]), tf.constant(Y[LO:HI])

    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(w, b, x, y)
        gw, gb = hvd.DistributedGradientTape(tape, process_set=MINE).gradient(loss, [w, b])
        w.assign_sub(LR * gw)
        b.assign_sub(LR * gb)

    for _ in range(STEPS):
        step()
    ref_w, ref_b = reference()
    np.testing.assert_allclose(w.numpy(), ref_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b.numpy(), ref_b, rtol=1e-5, atol=1e-6)


def test_legacy_optimizer_per_set_in_a_graph():
    with tf.Graph().as_default():
        w = tf.compat.v1.get_variable("w", initializer=W0)
        b = tf.compat.v1.get_variable("b", initializer=tf.zeros(2))
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LR),
                                       process_set=MINE)
        train = opt.minimize(loss_fn(w, b, tf.constant(X[LO:HI]), tf.constant(Y[LO:HI])))
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for _ in range(STEPS):
                sess.run(train)
            got = sess.run(w)
    np.testing.assert_allclose(got, reference()[0], rtol=1e-5, atol=1e-6)


def test_keras_optimizer_per_set():
    w, b = tf.Variable(W0), tf.Variable(tf.zeros(2))
    opt = hvdk.DistributedOptimizer(tf.keras.optimizers.SGD(LR), process_set=MINE)
    x, y = tf.constant(X[LO:HI]), tf.constant(Y[LO:HI])
    for _ in range(STEPS):
        with tf.GradientTape() as tape:
            loss = loss_fn(w, b, x, y)
        opt.apply_gradients(zip(tape.gradient(loss, [w, b]), [w, b]))
    np.testing.assert_allclose(w.numpy(), reference()[0], rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(N < 2, reason="needs a rank outside a set")
def test_a_rank_outside_the_set_keeps_its_gradients():
    w = tf.Variable(W0)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * float(R + 1))
    (g,) = hvd.DistributedGradientTape(tape, process_set=OTHER).gradient(loss, [w])
    if R in OTHER.ranks:
        pytest.fail("OTHER is the other parity's set")
    np.testing.assert_allclose(g.numpy(), np.full(W0.shape, R + 1.0))


@pytest.mark.skipif(N < 2, reason="needs a rank outside a set")
def test_a_collective_on_a_set_this_rank_is_not_in_is_invalid_argument():
    """Horovod's op fails with tf.errors.InvalidArgumentError, eagerly and in graphs; the
    error names the rank and the set. Every collective refuses, and the runtime goes on."""
    want = f"rank {R} is not a member of process set {OTHER.process_set_id} (job ranks {OTHER.ranks})"
    calls = {"allreduce": lambda: hvd.allreduce(tf.ones(2), process_set=OTHER),
             "grouped_allreduce": lambda: hvd.grouped_allreduce([tf.ones(2)], process_set=OTHER),
             "allgather": lambda: hvd.allgather(tf.ones(2), process_set=OTHER),
             "broadcast": lambda: hvd.broadcast(tf.ones(2), OTHER.ranks[0], process_set=OTHER),
             "alltoall": lambda: hvd.alltoall(tf.ones(2), process_set=OTHER),
             "reducescatter": lambda: hvd.reducescatter(tf.ones(2), process_set=OTHER)}
    for what, call in calls.items():
        with pytest.raises(tf.errors.InvalidArgumentError, match=re.escape(f"{what}: {want}")):
            call()
    with pytest.raises(tf.errors.InvalidArgumentError, match="is not a member"):
        tf.function(lambda: hvd.allreduce(tf.ones(2), process_set=OTHER))()
    with tf.Graph().as_default():
        with pytest.raises(tf.errors.InvalidArgumentError, match="is not a member"):
            hvd.allreduce(tf.ones(2), process_set=OTHER)
    # Still horolite's InvalidCollectiveError too, and the runtime keeps working.
    with pytest.raises(hvd.InvalidCollectiveError):
        hvd.allreduce(tf.ones(2), process_set=OTHER)
    got = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum, name="ps.after.refusal")
    np.testing.assert_allclose(got.numpy(), [float(N)])


def test_a_set_never_registered_is_a_value_error_and_invalid_argument():
    """Horovod: ValueError from allreduce (process_set.size()), InvalidArgumentError from
    the ops that ask the runtime; horolite's error is both."""
    fake = hvd.ProcessSet([0])
    fake.process_set_id = 10
    for call in (lambda: hvd.allreduce(tf.ones(2), process_set=fake),
                 lambda: hvd.allgather(tf.ones(2), process_set=fake)):
        for cls in (ValueError, tf.errors.InvalidArgumentError):
            with pytest.raises(cls, match="is not registered"):
                call()
    with pytest.raises(ValueError, match="Process set does not exist or has not been registered"):
        fake.size()
    assert hvd.mpi_ops._basics._get_process_set_ids_and_ranks()[MINE.process_set_id] == MINE.ranks
    assert hvd.mpi_ops._basics._process_set_size(0) == N
    with pytest.raises(ValueError, match="does not exist"):
        hvd.mpi_ops._basics._process_set_rank(10)


def test_collectives_on_a_set():
    members = MINE.ranks
    got = hvd.allreduce(tf.constant([float(R)] * 2), op=hvd.Sum, process_set=MINE)
    np.testing.assert_allclose(got.numpy(), [float(sum(members))] * 2)
    v = tf.Variable(tf.ones(3) * float(R))
    with tf.GradientTape() as tape:
        gathered = hvd.allgather(tf.reshape(v, [1, 3]), process_set=MINE)
        loss = tf.reduce_sum(gathered)
    np.testing.assert_allclose(gathered.numpy()[:, 0], members)
    np.testing.assert_allclose(tape.gradient(loss, v).numpy(), np.ones(3))  # averaged, then mine
    root = members[-1]
    np.testing.assert_allclose(hvd.broadcast(tf.constant([R]), root, process_set=MINE).numpy(), [root])
    got = hvd.alltoall(tf.constant([[R, d] for d in range(SN)]), process_set=MINE).numpy()
    assert got.tolist() == [[r, SR] for r in members]
    full = sum(np.arange(2 * SN, dtype=np.float32) + r for r in members)
    got = hvd.reducescatter(tf.constant(np.arange(2 * SN, dtype=np.float32) + R), op=hvd.Sum,
                            process_set=MINE)
    np.testing.assert_allclose(got.numpy(), full[2 * SR:2 * SR + 2])
    (a,) = hvd.grouped_allreduce([tf.constant([1.0])], op=hvd.Sum, process_set=MINE)
    assert float(a.numpy()[0]) == SN
    var = tf.Variable(float(R))
    hvd.broadcast_variables([var], root_rank=members[0], process_set=MINE)
    assert float(var.numpy()) == members[0]
    assert hvd.broadcast_object({"r": R}, root_rank=root, process_set=MINE) == {"r": root}
    assert hvd.allgather_object(R, process_set=MINE) == members
    assert int(hvd.size_op(MINE.process_set_id)) == SN
    assert int(hvd.process_set_included_op(MINE.process_set_id)) == 1
    if N > 1:
        assert int(hvd.process_set_included_op(OTHER.process_set_id)) == 0
