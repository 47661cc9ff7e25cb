"""Compare the distributed optimizers on the digits data (scikit-learn, no download):
DistributedOptimizer (gradients averaged every step), ModelAverageOptimizer (local
SGD, models averaged every --interval steps), ElasticAverageOptimizer (EASGD) and
SyncReplicasOptimizer with one backup worker (each step takes the first size-1
ranks' gradients).

Stragglers are injected so that the difference shows: at every step one rank,
drawn at random (the same draw on every rank), sleeps --straggler-ms before its
step, as a rank on a busy host would. Each rank takes its share of every global
batch. Printed on rank 0: a table of test accuracy (of the shared model; for
model averaging after a final average, for EASGD of the center variables) and
seconds per epoch (the slowest rank's, measured with a barrier at each epoch end).

    horolite-run -np 4 python examples/wrapper_optimizers_digits.py
    horolite-run -np 2 python examples/wrapper_optimizers_digits.py --epochs 2 --straggler-ms 0
"""
import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import horolite.tensorflow as hvd

GLOBAL_BATCH = 60  # divisible by 1, 2, 3, 4 ranks
LR = 0.05


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--interval", type=int, default=4, help="model averaging / EASGD period (steps)")
    p.add_argument("--straggler-ms", type=float, default=20.0,
                   help="delay of the one straggling rank at each step (0: none)")
    p.add_argument("--only", choices=["distributed", "average", "easgd", "backup"], action="append",
                   help="run only these (repeatable)")
    return p.parse_args()


def make_model():
    return tf.keras.Sequential([tf.keras.Input((64,)), tf.keras.layers.Dense(64, activation="relu"),
                                tf.keras.layers.Dense(10)])


def make_optimizer(strategy, args):
    sgd = tf.keras.optimizers.SGD(LR, momentum=0.9)
    if strategy == "distributed":
        return hvd.DistributedOptimizer(sgd)
    if strategy == "average":
        return hvd.ModelAverageOptimizer(sgd, interval_steps=args.interval)
    if strategy == "easgd":
        return hvd.ElasticAverageOptimizer(sgd, communication_period=args.interval)
    return hvd.SyncReplicasOptimizer(sgd, replicas_to_aggregate=max(hvd.size() - 1, 1))


def train(strategy, args, data):
    rank, size = hvd.rank(), hvd.size()
    x_train, y_train, x_test, y_test = data
    tf.random.set_seed(1234 + rank)  # different on purpose: the broadcast makes them equal
    model = make_model()
    hvd.broadcast_variables(model.variables, root_rank=0)
    opt = make_optimizer(strategy, args)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    order = np.random.RandomState(0)
    stragglers = np.random.RandomState(1)  # same draws on every rank
    steps = len(x_train) // GLOBAL_BATCH
    epoch_times = []
    for epoch in range(args.epochs):
        hvd.barrier()
        start = time.perf_counter()
        perm = order.permutation(len(x_train))
        for i in range(steps):
            if args.straggler_ms and size > 1 and stragglers.randint(size) == rank:
                time.sleep(args.straggler_ms / 1000.0)
            batch = perm[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH][rank::size]  # this rank's share
            train_step(x_train[batch], y_train[batch])
        hvd.barrier()
        epoch_times.append(time.perf_counter() - start)

    variables = model.trainable_variables
    if strategy == "average":  # the final model: the average of the ranks' models
        for v, m in zip(variables, hvd.grouped_allreduce([tf.convert_to_tensor(v) for v in variables])):
            v.assign(m)
    elif strategy == "easgd":  # the model is the center
        for v in variables:
            v.assign(opt.center_variable(v))
    accuracy = float(np.mean(np.argmax(model(x_test).numpy(), axis=1) == y_test))
    accuracies = hvd.allgather_object(accuracy)
    assert len(set(accuracies)) == 1, f"{strategy}: ranks evaluate different models: {accuracies}"
    # The first epoch includes tracing: leave it out when there are others.
    per_epoch = float(np.mean(epoch_times[1:] if len(epoch_times) > 1 else epoch_times))
    return accuracy, per_epoch


def main():
    args = parse_args()
    hvd.init()
    if GLOBAL_BATCH % hvd.size():
        raise SystemExit(f"run on a number of ranks that divides {GLOBAL_BATCH}")
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, digits.target, test_size=0.2, random_state=0)
    names = {"distributed": "DistributedOptimizer",
             "average": f"ModelAverageOptimizer(interval_steps={args.interval})",
             "easgd": f"ElasticAverageOptimizer(communication_period={args.interval})",
             "backup": f"SyncReplicasOptimizer(replicas_to_aggregate={max(hvd.size() - 1, 1)})"}
    rows = []
    for strategy in args.only or list(names):
        accuracy, per_epoch = train(strategy, args, (x_train, y_train, x_test, y_test))
        rows.append((names[strategy], accuracy, per_epoch))
    if hvd.rank() == 0:
        print(f"ranks: {hvd.size()}, epochs: {args.epochs}, straggler: {args.straggler_ms:g} ms per step")
        print("| optimizer | test accuracy | s/epoch |")
        print("|---|---|---|")
        for name, accuracy, per_epoch in rows:
            print(f"| {name} | {accuracy:.4f} | {per_epoch:.3f} |")


if __name__ == "__main__":
    main()
