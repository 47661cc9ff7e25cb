"""A rank failing during TensorFlow training: the others' TF error keeps the cause.

    python tf_cause.py OUTDIR     (tests/test_failures.py runs it under mpirun)
"""
import os
import sys

import tensorflow as tf

import horolite.tensorflow as hvd

OUTDIR = sys.argv[1]
hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(2)])
opt = tf.keras.optimizers.SGD(0.01)


@tf.function
def step(x):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x) ** 2)
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    return loss


try:
    for i in range(200):
        if RANK == SIZE - 1 and i == 3:
            raise RuntimeError("bad batch")
        step(tf.ones((8, 4)))
except tf.errors.OpError as e:
    with open(os.path.join(OUTDIR, f"rank.{RANK}"), "w") as f:
        f.write(f"{type(e).__name__}: {e.message}\n")
    raise
