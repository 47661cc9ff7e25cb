"""Train a digit classifier (scikit-learn's load_digits, no download) with
DistributedGradientTape. Each rank takes its share of every global batch, the
initial weights are broadcast from rank 0, and the test accuracy is the same
on any number of ranks (the global batch and its order do not depend on it).

    horolite-run -np 2 python examples/tensorflow2_digits.py
    (or: mpirun -np 2 python examples/tensorflow2_digits.py)
"""
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import horolite.tensorflow as hvd

GLOBAL_BATCH = 60  # divisible by 1, 2, 3, 4 ranks
EPOCHS = 15
LR = 0.05


def main():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if GLOBAL_BATCH % size:
        raise SystemExit(f"run on a number of ranks that divides {GLOBAL_BATCH}")
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, digits.target, test_size=0.2, random_state=0)

    tf.random.set_seed(1234 + rank)  # different on purpose: the broadcast makes them equal
    model = tf.keras.Sequential([tf.keras.Input((64,)), tf.keras.layers.Dense(64, activation="relu"),
                                 tf.keras.layers.Dense(10)])
    opt = tf.keras.optimizers.SGD(LR, momentum=0.9)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    hvd.broadcast_variables(model.variables, root_rank=0)
    order = np.random.RandomState(0)
    start = time.time()
    steps = len(x_train) // GLOBAL_BATCH
    for epoch in range(EPOCHS):
        perm = order.permutation(len(x_train))
        for i in range(steps):
            batch = perm[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH][rank::size]  # this rank's share
            loss = train_step(x_train[batch], y_train[batch])
        if rank == 0 and (epoch % 5 == 4 or epoch == EPOCHS - 1):
            print(f"epoch {epoch + 1}: rank 0 batch loss {float(loss):.4f}", flush=True)
    accuracy = float(np.mean(np.argmax(model(x_test).numpy(), axis=1) == y_test))
    # Every rank holds the same weights, so every rank computes the same accuracy.
    accuracies = hvd.allgather_object(accuracy)
    assert len(set(accuracies)) == 1, accuracies
    if rank == 0:
        print(f"ranks: {size}  test accuracy: {accuracy:.4f}  train time: {time.time() - start:.1f} s")


if __name__ == "__main__":
    main()
