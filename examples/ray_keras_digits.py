"""Train the digits classifier (scikit-learn's load_digits) with Keras fit on Ray.

Two ways, the same training function:

    python examples/ray_keras_digits.py --workers 2              # Ray Train + HorovodConfig
    python examples/ray_keras_digits.py --workers 2 --executor   # horolite.ray.RayExecutor

It joins the Ray cluster RAY_ADDRESS names (``ray start --head`` first), or starts a local
one. Each worker trains on its share of the data with the DistributedOptimizer; rank 0
reports the test accuracy (under Ray Train, with the model as its checkpoint).
"""
import argparse
import os

import numpy as np
import ray

EPOCHS = 8


def train(report=False):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    import horolite.tensorflow.keras as hvd

    hvd.init()
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, digits.target, test_size=0.2,
                                                        random_state=0)
    x_train, y_train = x_train[hvd.rank()::hvd.size()], y_train[hvd.rank()::hvd.size()]
    model = tf.keras.Sequential([tf.keras.Input((64,)),
                                 tf.keras.layers.Dense(64, activation="relu"),
                                 tf.keras.layers.Dense(10)])
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.02 * hvd.size(), momentum=0.9))
    model.compile(optimizer=opt, jit_compile=False, metrics=["accuracy"],
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x_train, y_train, batch_size=32, epochs=EPOCHS, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                         hvd.callbacks.MetricAverageCallback()])
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    result = {"rank": hvd.rank(), "size": hvd.size(), "accuracy": float(accuracy)}
    if report:  # under Ray Train: every worker reports, rank 0 with the model
        import tempfile
        import ray.train
        with tempfile.TemporaryDirectory() as d:
            checkpoint = None
            if hvd.rank() == 0:
                model.save(os.path.join(d, "digits.keras"))
                checkpoint = ray.train.Checkpoint.from_directory(d)
            ray.train.report(result, checkpoint=checkpoint)
    return result


def train_loop(config):
    """Ray Train's entry: train, and report."""
    train(report=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--executor", action="store_true",
                   help="run with horolite.ray.RayExecutor instead of Ray Train")
    p.add_argument("--storage-path", default=None,
                   help="where Ray Train keeps its runs (default: ~/ray_results)")
    args = p.parse_args()
    ray.init(address=os.environ.get("RAY_ADDRESS"))
    if args.executor:
        from horolite.ray import RayExecutor
        executor = RayExecutor(RayExecutor.create_settings(timeout_s=120),
                               num_workers=args.workers)
        executor.start()
        try:
            results = executor.run(train)
        finally:
            executor.shutdown()
        accuracy = results[0]["accuracy"]
    else:
        from ray.train import RunConfig, ScalingConfig
        from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
        from horolite.ray import HorovodConfig
        trainer = DataParallelTrainer(train_loop,
                                      backend_config=HorovodConfig(timeout_s=120),
                                      scaling_config=ScalingConfig(num_workers=args.workers),
                                      run_config=RunConfig(storage_path=args.storage_path))
        result = trainer.fit()
        if result.error is not None:
            raise result.error
        accuracy = result.metrics["accuracy"]
        print(f"rank 0's model: {result.checkpoint.path}/digits.keras")
    print(f"test accuracy on {args.workers} Ray workers: {accuracy:.4f}")


if __name__ == "__main__":
    main()
