"""horolite.ray.HorovodConfig as a Ray Train backend (Ray Train V2, as Ray ships it): a
tf.function tape loop and Keras fit, their weights checked against NumPy through the
checkpoint rank 0 reports. The fit runs with ScalingConfig(use_gpu=True) on the node
that says it has 2 GPUs, and checks that each worker sees both, in local-rank order.
And Ray Train's own restart of the group (FailureConfig) resuming from the checkpoint."""
import json
import os
import tempfile

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from ray.train import Checkpoint, RunConfig, ScalingConfig  # noqa: E402
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer  # noqa: E402

from horolite.ray import HorovodConfig  # noqa: E402
from test_ray_gpus import check_each_rank_picks_its_own, what_a_rank_sees  # noqa: E402

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
    if config.get("dir"):  # (what this rank sees of its node's GPUs)
        with open(os.path.join(config["dir"], f"seen.{hvd.rank()}"), "w") as f:
            json.dump(what_a_rank_sees(), f)
    x, y = data(hvd.rank())
    model = tf.keras.Sequential([tf.keras.Input((DIM,)),
                                 tf.keras.layers.Dense(1, use_bias=False,
                                                       kernel_initializer="zeros")])
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(LR)),
                  loss="mse", jit_compile=False)
    model.fit(x, y, batch_size=ROWS, epochs=STEPS, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    report_weights(model.get_weights()[0], hvd)


@pytest.mark.parametrize("loop,np_,gpus", [(tape_loop, 3, False), (fit_loop, 2, True)],
                         ids=["tape-np3", "fit-np2-gpus"])
def test_ray_train_runs_a_horolite_loop(ray_cluster, loop, np_, gpus, tmp_path):
    trainer = DataParallelTrainer(
        loop, train_loop_config={"dir": str(tmp_path) if gpus else None},
        backend_config=HorovodConfig(timeout_s=120),
        scaling_config=ScalingConfig(num_workers=np_, use_gpu=gpus),
        run_config=RunConfig(storage_path=str(tmp_path), name=loop.__name__))
    result = trainer.fit()
    assert result.error is None, result.error
    if gpus:
        check_each_rank_picks_its_own([json.loads((tmp_path / f"seen.{r}").read_text())
                                       for r in range(np_)])
    with result.checkpoint.as_directory() as d:
        w = np.load(os.path.join(d, "w.npy"))
    np.testing.assert_allclose(w, numpy_weights(np_), rtol=1e-4, atol=1e-5)
    assert not np.allclose(numpy_weights(np_), numpy_weights(1))  # the average mattered


def restarting_loop(config):
    """Full-batch SGD on NumPy, resuming from Ray Train's checkpoint; rank 1 kills its own
    process once, at step 2 (a marker file says it did)."""
    import signal
    import time
    import ray.train
    import horolite as hvd
    hvd.init()
    w, start = np.zeros((DIM, 1)), 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            w, start = np.load(os.path.join(d, "w.npy")), int(np.load(os.path.join(d, "step.npy")))
    x, y = (a.astype(np.float64) for a in data(hvd.rank()))
    for step in range(start, STEPS):
        w = w - LR * hvd.allreduce(2.0 / ROWS * x.T @ (x @ w - y), name="grad")
        if step == 2 and hvd.rank() == 1 and not os.path.exists(config["marker"]):
            open(config["marker"], "w").close()
            time.sleep(2.0)  # (Ray Train's controller takes in the reports so far)
            os.kill(os.getpid(), signal.SIGKILL)
        metrics = {"step": step, "started_at": start}
        if hvd.rank() != 0:
            ray.train.report(metrics)
            continue
        with tempfile.TemporaryDirectory() as d:
            np.save(os.path.join(d, "w.npy"), w)
            np.save(os.path.join(d, "step.npy"), np.array(step + 1))
            ray.train.report(metrics, checkpoint=Checkpoint.from_directory(d))


def test_ray_train_restarts_the_group_from_its_checkpoint(ray_cluster, tmp_path):
    """FailureConfig(max_failures=1): a worker killed mid-training, Ray Train restarts
    the whole group (a new horolite world, with a new key and rendezvous), the loop
    resumes from rank 0's last checkpoint, and the weights are NumPy's for the whole run."""
    from ray.train import FailureConfig
    marker = tmp_path / "killed"
    trainer = DataParallelTrainer(
        restarting_loop, train_loop_config={"marker": str(marker)},
        backend_config=HorovodConfig(timeout_s=60),
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=str(tmp_path), name="restart",
                             failure_config=FailureConfig(max_failures=1)))
    result = trainer.fit()
    assert result.error is None, result.error
    assert marker.exists()  # (rank 1 was killed once)
    assert result.metrics["started_at"] > 0, result.metrics  # resumed, not started over
    with result.checkpoint.as_directory() as d:
        w = np.load(os.path.join(d, "w.npy"))
    np.testing.assert_allclose(w, numpy_weights(2), rtol=1e-10)
