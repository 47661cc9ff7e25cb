"""Rank side: what buckets guarantee when a step fails on one rank, or when a gradient's kind
differs between ranks.

Buckets are on in every run of this file (HOROLITE_GRADIENT_BUCKET_MB=0.3 unless the
driver set a cap). Each case that could hang is bounded (fail_if_hung): a hang ends the
rank with every thread's stack in its log rather than the driver's timeout.
- A gradient that is tf.IndexedSlices on one rank and None on another fails every rank at
  once, naming the variable and the ranks; the rows of a sparse gradient go only after
  the bucket that holds its marker, so a step failing below it leaves nothing behind.
- With backward_passes_per_step > 1, a pass that fails part way adds nothing to the sums.
- With DistributedGradientTape and the user's own Keras optimizer, a failed step applies
  nothing on any rank: neither the gradients nor what needs none (AdamW's weight decay,
  iterations).
- The edges that let buckets leave during backprop close no cycle through TensorFlow's own
  orderings (a variable that backprop writes, with tied weights), and a legacy random op
  in backprop costs none of them.
Values are checked against plain Keras on every rank's batches (gradients exchanged with
mpi4py, never with horolite).
"""
import faulthandler
import os
import re
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("HOROLITE_GRADIENT_BUCKET_MB", "0.3")

import keras
import numpy as np
import pytest
import tensorflow as tf
from horolite.core.mpi_library import MPI  # the job world's: mpi4py's under mpirun

import horolite.tensorflow as hvd
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


# ---- a gradient that is IndexedSlices on one rank and None on another ----

@pytest.mark.parametrize("mode", ["eager", "function"])
def test_a_gradient_sparse_on_one_rank_and_none_on_another_fails_every_rank_at_once(mode):
    # Rank 1 skips the Embedding (its gradient there is None), rank 0 looks rows up (its
    # gradient is IndexedSlices). Before, rank 0 sent the rows as allgathers that rank 1
    # never sent and the ranks cut different buckets: in a function every rank waited
    # for ever; eagerly the allgathers stayed in flight and the next step hung. Now every
    # rank fails at once naming the variable and the ranks, and the next steps work.
    _two_ranks()
    log = fail_if_hung(120)
    try:
        keras.utils.set_random_seed(19)
        embedding = keras.layers.Embedding(64, WIDTH)
        layers = [keras.layers.Dense(WIDTH, activation="tanh") for _ in range(4)] + [keras.layers.Dense(4)]
        model = keras.Sequential([keras.Input((WIDTH,))] + layers)
        embedding.build((None, 3))
        variables = [embedding.embeddings] + model.trainable_variables
        x = batch(R, 16)[0]
        ids = tf.constant(np.random.RandomState(R).randint(0, 64, size=(16, 3)), tf.int32)

        def forward(skip):
            h = x if skip else x + tf.reduce_mean(embedding(ids), axis=1)
            for layer in layers:
                h = layer(h)
            return tf.reduce_mean(tf.square(h))

        def step(skip):
            with tf.GradientTape() as tape:
                loss = forward(skip)
            return hvd.DistributedGradientTape(tape).gradient(loss, variables)
        run = step if mode == "eager" else tf.function(step)
        started = time.monotonic()
        with pytest.raises(tf.errors.OpError, match=r"mismatched .*shapes?: ranks? 0(, \d+)* had .*rank 1 had") as info:
            run(R == 1)
        assert time.monotonic() - started < 60
        assert re.search(rf"the gradients of \S*{embedding.embeddings.path}[,;]", str(info.value))
        assert "IndexedSlices" in str(info.value) and "None on that rank" in str(info.value)
        for _ in range(2):  # every rank whole again, and the rows travel apart as before
            got = run(False)
    finally:
        faulthandler.cancel_dump_traceback_later()
        if log is not None:
            log.close()
    assert isinstance(got[0], tf.IndexedSlices)
    with tf.GradientTape() as tape:  # plain TensorFlow: this rank's own gradients
        loss = forward(False)
    local = [tf.convert_to_tensor(g).numpy() for g in tape.gradient(loss, variables)]
    every = COMM.allgather(local)
    for k, g in enumerate(got):
        np.testing.assert_allclose(tf.convert_to_tensor(g).numpy(),
                                   np.mean([e[k] for e in every], axis=0), rtol=1e-5, atol=1e-6,
                                   err_msg=f"gradient {k}")


def embedding_model(flag):
    """(an Embedding whose rows are added to the input of failing_model, all variables)"""
    keras.utils.set_random_seed(23)
    embedding = keras.layers.Embedding(64, WIDTH)
    embedding.build((None, 3))
    model = failing_model(flag, layers=5)
    return embedding, model, [embedding.embeddings] + model.trainable_variables


def embedding_loss(embedding, model, r, rows):
    x, y = batch(r, rows)
    ids = tf.constant(np.random.RandomState(r).randint(0, 64, size=(rows, 3)), tf.int32)
    h = x + tf.reduce_mean(embedding(ids), axis=1)
    return keras.losses.MeanSquaredError()(y, model(h, training=True))


def average(grads):
    """Every rank's gradient averaged: IndexedSlices as every rank's rows, in rank order."""
    if isinstance(grads[0], tf.IndexedSlices):
        return tf.IndexedSlices(tf.concat([g.values for g in grads], 0) / N,
                                tf.concat([g.indices for g in grads], 0), grads[0].dense_shape)
    return tf.add_n(list(grads)) / N


def test_a_tape_step_failing_on_one_rank_applies_nothing_anywhere_then_trains_on():
    # DistributedGradientTape and a plain Keras AdamW(weight_decay=0.1). Rank 1 fails below
    # the layer above the Embedding, before the bucket holding the rows' marker left.
    # - The weight decay and iterations need no gradient: before, they ran in the failed
    #   step on the ranks its error had not stopped yet (rank 1's weights decayed). Now no
    #   weight and no optimizer variable changes on any rank.
    # - No rank sends the rows (they go after that bucket): rank 1's next step must not
    #   announce them as never coming (nobody would answer, and its next healthy step
    #   would fail on the stale notice).
    # Afterwards training matches plain Keras on every rank's batches.
    _two_ranks()
    log = fail_if_hung(120)
    try:
        flag = tf.Variable(0.0, trainable=False)
        embedding, model, variables = embedding_model(flag)
        opt = keras.optimizers.AdamW(1e-3, weight_decay=0.1)

        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = embedding_loss(embedding, model, R, 32)
            grads = hvd.DistributedGradientTape(tape).gradient(loss, variables)
            opt.apply_gradients(zip(grads, variables))
        step()
        before = [v.numpy() for v in variables + list(opt.variables)]
        fail_on_rank_1(flag, lambda _: step(), 32)
        for k, (v, b) in enumerate(zip(variables + list(opt.variables), before)):
            np.testing.assert_array_equal(v.numpy(), b, err_msg=f"variable {k} changed in the failed step")
        flag.assign(0.0)
        step()
        step()
    finally:
        faulthandler.cancel_dump_traceback_later()
        if log is not None:
            log.close()
    weights = [v.numpy() for v in variables]
    same_on_every_rank(weights, "weight")
    same_on_every_rank([v.numpy() for v in opt.variables], "optimizer variable")
    assert int(opt.iterations.numpy()) == 3  # the failed step counted nowhere
    embedding, model, variables = embedding_model(tf.Variable(0.0, trainable=False))
    plain = keras.optimizers.AdamW(1e-3, weight_decay=0.1)  # plain Keras, 3 steps
    for _ in range(3):
        per_rank = []
        for r in range(N):
            with tf.GradientTape() as tape:
                loss = embedding_loss(embedding, model, r, 32)
            per_rank.append(tape.gradient(loss, variables))
        plain.apply_gradients(zip([average(g) for g in zip(*per_rank)], variables))
    for k, (got, want) in enumerate(zip(weights, variables)):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-6, err_msg=f"weight {k}")

# ---- a pass that fails part way, with backward_passes_per_step=2 ----

def plain_gradients(model, r, rows):
    """Plain TensorFlow: rank r's gradients on its batch of `rows`."""
    x, y = batch(r, rows)
    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(y, model(x, training=True))
    return tape.gradient(loss, model.trainable_variables)


def test_a_pass_failing_part_way_adds_nothing_to_the_aggregated_sums():
    # Rank 1's second (exchanging) pass fails after the upper layers' gradients exist, then
    # it runs that pass again. Before, they were already in its sums, so its retry added
    # them twice and every rank applied that wrong update alike. Now the failed pass adds
    # nothing: the update is plain SGD on both passes' batches averaged over the ranks.
    _two_ranks()
    log = fail_if_hung(120)
    try:
        flag = tf.Variable(0.0, trainable=False)
        model = failing_model(flag)
        opt = keras.optimizers.SGD(0.1)  # zeros (the pass that does not exchange) change nothing

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = keras.losses.MeanSquaredError()(y, model(x, training=True))
            tape = hvd.DistributedGradientTape(tape, backward_passes_per_step=2)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
        step(*batch(R, 32))
        flag.assign(1.0 if R == 1 else 0.0)
        if R == 1:  # (the others' pass waits in the exchange for rank 1's retry)
            with pytest.raises(tf.errors.InvalidArgumentError, match="reshape"):
                step(*batch(R + 100, 32))
            flag.assign(0.0)
        step(*batch(R + 100, 32))  # (another batch of the same shape: one trace)
    finally:
        faulthandler.cancel_dump_traceback_later()
        if log is not None:
            log.close()
    weights = [v.numpy() for v in model.trainable_variables]
    same_on_every_rank(weights, "weight")
    plain = failing_model(tf.Variable(0.0, trainable=False))
    every = [[a + b for a, b in zip(plain_gradients(plain, r, 32),
                                    plain_gradients(plain, r + 100, 32))] for r in range(N)]
    for k, (got, v) in enumerate(zip(weights, plain.trainable_variables)):
        want = v.numpy() - 0.1 * np.mean([e[k].numpy() for e in every], axis=0)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"weight {k}")


# ---- backprop that writes a variable, with tied weights: no cycle ----

def test_backprop_writing_a_variable_twice_with_tied_weights_makes_no_cycle():
    # A custom gradient adds to a variable in backprop twice (a gradient-norm record, the
    # lower write under a control dependency), and a weight used at the bottom and the top
    # has its gradient in the first bucket, made late. TensorFlow orders the two writes
    # after tracing: the first bucket's edge into the rest of backprop then closed a
    # cycle through them ("nodes in a cycle" on the first call). Now no edge goes where
    # TensorFlow's per-resource order leads back to the bucket's enqueue.
    _two_ranks()
    width = 384  # each weight larger than the first bucket: one bucket each
    rng = np.random.RandomState(29)
    tied, w1, w2 = [tf.Variable(rng.normal(0, 0.05, (width, width)).astype(np.float32))
                    for _ in range(3)]
    record = tf.Variable(0.0)

    @tf.custom_gradient
    def tap(x):  # identity; its backward adds |dy|^2 to `record`
        def grad(dy):
            with tf.control_dependencies([record.assign_add(tf.reduce_sum(dy * dy))]):
                return tf.identity(dy)
        return tf.identity(x), grad

    def loss_of(x):
        h = tap(x @ tied)
        h = tf.tanh(h @ w1)
        h = tf.tanh(h @ tap(tf.identity(w2)))
        return tf.reduce_mean(tf.square(h @ tied))
    variables = [w1, w2, tied]
    x = tf.constant(np.random.RandomState(R).normal(size=(16, width)).astype(np.float32))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = loss_of(x)
        return hvd.DistributedGradientTape(tape).gradient(loss, variables)
    got = [g.numpy() for g in step()]
    with tf.GradientTape() as tape:  # plain TensorFlow, this rank's own gradients
        loss = loss_of(x)
    every = COMM.allgather([g.numpy() for g in tape.gradient(loss, variables)])
    for k, g in enumerate(got):
        np.testing.assert_allclose(g, np.mean([e[k] for e in every], axis=0), rtol=1e-5,
                                   atol=1e-6, err_msg=f"gradient {k}")


def test_a_legacy_random_op_low_in_backprop_keeps_every_bucket_in_backprops_order():
    # TensorFlow does not chain legacy random ops (nor CudnnRNN, the GPU LSTM's): counted
    # as chained, one at the bottom of backprop kept the edges off the chain of gradients
    # with respect to the layers' inputs, which TensorFlow's executor then followed to its
    # end before any bucket left.
    _two_ranks()

    @tf.custom_gradient
    def jitter(x):  # identity; its backward draws from a legacy (stateful) random op
        def grad(dy):
            return dy + tf.compat.v1.random_shuffle(dy * 0.0)  # (zeros, from dy)
        return tf.identity(x), grad

    def held_ops(with_jitter):
        """(ops that wait for a bucket's enqueue, enqueues) in a tape step's graph"""
        keras.utils.set_random_seed(31)
        layers = [keras.layers.Dense(256, activation="tanh") for _ in range(8)]  # a bucket each
        model = keras.Sequential([keras.Input((WIDTH,))] + layers)
        x = batch(R, 16)[0]

        @tf.function
        def step():
            with tf.GradientTape() as tape:
                h = layers[0](x)
                h = jitter(h) if with_jitter else tf.identity(h)
                for layer in layers[1:]:
                    h = layer(h)
                loss = tf.reduce_mean(h)
            return hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
        graph = step.get_concrete_function().graph
        assert with_jitter == any(op.type == "RandomShuffle" for op in graph.get_operations())
        enqueues = {op for op in graph.get_operations() if op.type == "HorolitEnqueue"}
        held = [op for op in graph.get_operations() if op.type not in ("NoOp", "Identity")
                and any(c in enqueues for c in op.control_inputs)]
        return len(held), len(enqueues)
    plain, jittered = held_ops(False), held_ops(True)
    assert plain[1] >= 4 and jittered[1] == plain[1]
    assert jittered[0] >= plain[0], f"{jittered[0]} ops wait for an enqueue, {plain[0]} without it"


def test_the_stand_ins_of_a_step_are_checked_by_one_assert():
    # Each None gradient's placeholder was read by an Assert of its own: stateful ops that
    # TensorFlow runs one after another, one per variable without a gradient.
    _two_ranks()
    keras.utils.set_random_seed(37)
    layers = [keras.layers.Dense(WIDTH, activation="tanh") for _ in range(12)]
    model = keras.Sequential([keras.Input((WIDTH,))] + layers)
    x = batch(R, 16)[0]

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            h = x
            for layer in layers[:4] + layers[10:]:  # 6 layers unused: 12 None gradients
                h = layer(h)
            loss = tf.reduce_mean(h)
        return hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
    graph = step.get_concrete_function().graph
    got = step()
    assert sum(g is None for g in got) == 12
    asserts = [op for op in graph.get_operations() if op.type == "Assert"]
    assert len(asserts) == 1, [op.name for op in asserts]
