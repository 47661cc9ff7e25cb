"""Rank side: SyncBatchNormalization normalizes by the global batch's statistics,
backprops as the global batch, and trains like one process with plain
BatchNormalization on the whole batch.

Run by tests/test_matrix_tensorflow.py under mpirun -np 1..4.
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import pytest
import tensorflow as tf

import horolite.tensorflow as hvd
import horolite.tensorflow.keras as hvdk

hvd.init()
R, N = hvd.rank(), hvd.size()
keras = tf.keras
EPS = 1e-3
MOMENTUM = 0.9


def rank_rows(r, shape, uneven=True):
    """Rank r's known input: r + 2 rows (uneven) or 3 rows, offset so the mean is far from 0."""
    rows = r + 2 if uneven else 3
    rng = np.random.RandomState(100 + r)
    return (rng.normal(size=(rows,) + shape) * (1 + r) + 5.0).astype(np.float32)


def global_batch(shape, uneven=True):
    return np.concatenate([rank_rows(r, shape, uneven) for r in range(N)])


def make_layer(layer_cls, channels):
    layer = layer_cls(momentum=MOMENTUM, epsilon=EPS)
    layer.build((None,) + channels)
    layer.gamma.assign(np.linspace(0.5, 1.5, channels[-1]).astype(np.float32))
    layer.beta.assign(np.linspace(-1, 1, channels[-1]).astype(np.float32))
    return layer


@pytest.mark.parametrize("shape", [(3,), (2, 2, 3)], ids=["dense", "image"])
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_forward_uses_the_global_batch(shape, mode):
    layer = make_layer(hvd.SyncBatchNormalization, shape)
    x = rank_rows(R, shape)
    call = tf.function(lambda t: layer(t, training=True)) if mode == "function" else \
        (lambda t: layer(t, training=True))
    y = call(tf.constant(x)).numpy()

    full = global_batch(shape).astype(np.float64)
    axes = tuple(range(full.ndim - 1))
    mean, var = full.mean(axis=axes), full.var(axis=axes)
    gamma, beta = layer.gamma.numpy(), layer.beta.numpy()
    np.testing.assert_allclose(y, (x - mean) / np.sqrt(var + EPS) * gamma + beta, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(layer.moving_mean.numpy(), (1 - MOMENTUM) * mean, rtol=1e-5)
    np.testing.assert_allclose(layer.moving_variance.numpy(), MOMENTUM + (1 - MOMENTUM) * var, rtol=1e-4)
    # Inference uses the moving statistics (and communicates nothing).
    inferred = layer(tf.constant(x), training=False).numpy()
    mm, mv = layer.moving_mean.numpy(), layer.moving_variance.numpy()
    np.testing.assert_allclose(inferred, (x - mm) / np.sqrt(mv + EPS) * gamma + beta, rtol=1e-4, atol=1e-4)


def test_masked_rows_are_left_out_of_the_statistics():
    layer = make_layer(hvd.SyncBatchNormalization, (2, 3))
    x = rank_rows(R, (2, 3))  # (rows, time, channels) with a (rows, time) mask
    mask = np.ones(x.shape[:2], bool)
    mask[:, 1] = False
    y = layer(tf.constant(x), training=True, mask=tf.constant(mask)).numpy()
    kept = np.concatenate([rank_rows(r, (2, 3))[:, 0] for r in range(N)]).astype(np.float64)
    mean, var = kept.mean(axis=0), kept.var(axis=0)
    expect = (x - mean) / np.sqrt(var + EPS) * layer.gamma.numpy() + layer.beta.numpy()
    np.testing.assert_allclose(y, expect, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_gradient_is_the_global_batchs(mode):
    # Each rank's loss weighs its outputs by known coefficients; the gradient with
    # respect to this rank's input must be that of the sum of every rank's loss,
    # as plain BatchNormalization computes it on the whole batch in one process.
    shape = (3,)
    layer = make_layer(hvd.SyncBatchNormalization, shape)
    coeff = [np.random.RandomState(7 + r).normal(size=(r + 2,) + shape).astype(np.float32)
             for r in range(N)]
    x = tf.constant(rank_rows(R, shape))

    def grad():
        with tf.GradientTape() as t:
            t.watch(x)
            loss = tf.reduce_sum(layer(x, training=True) * coeff[R])
        return t.gradient(loss, x)

    got = (tf.function(grad) if mode == "function" else grad)().numpy()

    plain = make_layer(keras.layers.BatchNormalization, shape)
    full = tf.constant(global_batch(shape))
    with tf.GradientTape() as t:
        t.watch(full)
        loss = tf.reduce_sum(plain(full, training=True) * np.concatenate(coeff))
    expect = t.gradient(loss, full).numpy()
    start = sum(r + 2 for r in range(R))
    np.testing.assert_allclose(got, expect[start:start + R + 2], rtol=1e-4, atol=1e-5)


def model_with(norm_cls):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                              norm_cls(momentum=MOMENTUM, epsilon=EPS), keras.layers.Dense(2)])
    rng = np.random.RandomState(3)
    model.set_weights([rng.normal(size=w.shape).astype(np.float32) if w.ndim == 2 else
                       np.zeros(w.shape, np.float32) if i not in (4, 5) else w
                       for i, w in enumerate(model.get_weights())])
    return model


def test_fit_equals_one_process_with_plain_batch_norm():
    # Equal batches per rank: the averaged gradients are the whole batch's.
    x, y = global_batch((4,), uneven=False), global_batch((2,), uneven=False)
    mine = slice(3 * R, 3 * R + 3)
    model = model_with(hvdk.SyncBatchNormalization)
    model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse",
                  jit_compile=False)
    model.fit(x[mine], y[mine], batch_size=3, epochs=3, shuffle=False, verbose=0)

    ref = model_with(keras.layers.BatchNormalization)
    ref.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", jit_compile=False)
    ref.fit(x, y, batch_size=3 * N, epochs=3, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(N < 2, reason="a mismatch needs two ranks")
def test_channel_mismatch_names_the_layer_then_works():
    # Rank 0 normalizes 3 channels, the others 4: every rank's error names the layer's
    # gather and the shapes; the same layer name then works with agreeing shapes.
    channels = 3 if R == 0 else 4
    layer = hvd.SyncBatchNormalization(name="mismatched_bn")
    with pytest.raises(tf.errors.OpError, match="SyncBatchNormalization.mismatched_bn") as info:
        layer(tf.ones([2, channels]), training=True)
    assert "shape" in str(info.value), str(info.value)
    good = hvd.SyncBatchNormalization(name="agreeing_bn", epsilon=EPS)
    y = good(tf.constant(rank_rows(R, (3,))), training=True).numpy()
    full = global_batch((3,)).astype(np.float64)
    expect = (rank_rows(R, (3,)) - full.mean(0)) / np.sqrt(full.var(0) + EPS)
    np.testing.assert_allclose(y, expect, rtol=1e-4, atol=1e-4)


def test_saves_and_loads(tmp_path):
    model = model_with(hvd.SyncBatchNormalization)
    path = str(tmp_path / f"sync_bn_{R}.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded.layers[1]) is hvd.SyncBatchNormalization
    assert loaded.layers[1].momentum == MOMENTUM
    with pytest.raises(ValueError, match="fused=True"):
        hvd.SyncBatchNormalization(fused=True)
