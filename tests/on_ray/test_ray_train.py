"""horolite.ray.HorovodConfig as a Ray Train backend (Ray Train V2, as Ray ships it): a
tf.function tape loop and Keras fit, their weights checked against NumPy through the
checkpoint rank 0 reports."""
import os
import tempfile

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from ray.train import Checkpoint, RunConfig, ScalingConfig  # noqa: E402
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer  # noqa: E402

from horolite.ray import HorovodConfig  # noqa: E402

DIM, ROWS, STEPS, LR = 5, 8, 4, 0.1


def data(rank):
    rng = np.random.default_rng(7 + rank)
    x = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    return x, (x @ np.arange(1.0, DIM + 1) + 0.5).astype(np.float32).reshape(-1, 1)


def numpy_weights(size):
    """Full-batch SGD on mean squared error, gradients averaged over the ranks."""
    w = np.zeros((DIM, 1))
    for _ in range(STEPS):
        grads = []
        for r in range(size):
            x, y = (a.astype(np.float64) for a in data(r))
            grads.append(2.0 / ROWS * x.T @ (x @ w - y))
        w = w - LR * np.mean(grads, axis=0)
    return w


def report_weights(w, hvd):
    """Every rank reports (Ray Train waits for all); rank 0 with its weights as a checkpoint."""
    import ray.train
    metrics = {"rank": hvd.rank(), "size": hvd.size()}
    if hvd.rank() != 0:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory() as d:
        np.save(os.path.join(d, "w.npy"), w)
        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(d))


def tape_loop(config):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf
    import horolite.tensorflow as hvd
    hvd.init()
    x, y = data(hvd.rank())
    w = tf.Variable(tf.zeros((DIM, 1)))
    opt = tf.keras.optimizers.SGD(LR)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
        tape = hvd.DistributedGradientTape(tape)
        opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))
    for _ in range(STEPS):
        step()
    report_weights(w.numpy(), hvd)


def fit_loop(config):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf
    import horolite.tensorflow.keras as hvd
    hvd.init()
    x, y = data(hvd.rank())
    model = tf.keras.Sequential([tf.keras.Input((DIM,)),
                                 tf.keras.layers.Dense(1, use_bias=False,
                                                       kernel_initializer="zeros")])
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(LR)),
                  loss="mse", jit_compile=False)
    model.fit(x, y, batch_size=ROWS, epochs=STEPS, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    report_weights(model.get_weights()[0], hvd)


@pytest.mark.parametrize("loop,np_", [(tape_loop, 3), (fit_loop, 2)], ids=["tape-np3", "fit-np2"])
def test_ray_train_runs_a_horolite_loop(ray_cluster, loop, np_, tmp_path):
    trainer = DataParallelTrainer(
        loop, backend_config=HorovodConfig(timeout_s=120),
        scaling_config=ScalingConfig(num_workers=np_),
        run_config=RunConfig(storage_path=str(tmp_path), name=loop.__name__))
    result = trainer.fit()
    assert result.error is None, result.error
    with result.checkpoint.as_directory() as d:
        w = np.load(os.path.join(d, "w.npy"))
    np.testing.assert_allclose(w, numpy_weights(np_), rtol=1e-4, atol=1e-5)
    assert not np.allclose(numpy_weights(np_), numpy_weights(1))  # the average mattered
