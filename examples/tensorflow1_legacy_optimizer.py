"""TF1 graph mode under tf.compat.v1.Session: the legacy DistributedOptimizer with
local gradient aggregation (4 backward passes per update, averaged).

    horolite-run -np 2 python examples/tensorflow1_legacy_optimizer.py
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

import horolite.tensorflow as hvd

tf.compat.v1.disable_eager_execution()
PASSES = 4
STEPS = 400  # session steps (backward passes); the weights change every PASSES of them


def main():
    hvd.init()
    digits = load_digits()
    x_all = (digits.data / 16.0).astype(np.float32)[hvd.rank()::hvd.size()]  # this rank's shard
    y_all = digits.target[hvd.rank()::hvd.size()].astype(np.int64)

    x = tf.compat.v1.placeholder(tf.float32, [None, 64])
    y = tf.compat.v1.placeholder(tf.int64, [None])
    init = tf.compat.v1.glorot_uniform_initializer(seed=hvd.rank())  # differs: the hook broadcasts
    w1 = tf.compat.v1.get_variable("w1", [64, 64], initializer=init)
    b1 = tf.compat.v1.get_variable("b1", [64], initializer=tf.compat.v1.zeros_initializer())
    w2 = tf.compat.v1.get_variable("w2", [64, 10], initializer=init)
    b2 = tf.compat.v1.get_variable("b2", [10], initializer=tf.compat.v1.zeros_initializer())
    hidden = tf.nn.relu(tf.matmul(x, w1) + b1)
    logits = tf.matmul(hidden, w2) + b2
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
    accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1), y), tf.float32))
    global_step = tf.compat.v1.train.get_or_create_global_step()
    opt = hvd.DistributedOptimizer(tf.compat.v1.train.MomentumOptimizer(0.05, 0.9),
                                   backward_passes_per_step=PASSES, average_aggregated_gradients=True)
    train_op = opt.minimize(loss, global_step=global_step)
    mean_accuracy = hvd.allreduce(accuracy, name="mean_accuracy")

    hooks = [hvd.BroadcastGlobalVariablesHook(0),
             tf.compat.v1.train.StopAtStepHook(last_step=STEPS // PASSES)]
    rng = np.random.RandomState(hvd.rank())
    with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as sess:
        passes = 0
        while not sess.should_stop():
            idx = rng.randint(0, len(x_all), size=16)
            _, step = sess.run([train_op, global_step], {x: x_all[idx], y: y_all[idx]})
            passes += 1
            if passes % 100 == 0 and not sess.should_stop():
                acc = sess.run(mean_accuracy, {x: x_all, y: y_all})
                if hvd.rank() == 0:
                    print(f"pass {passes}, update {step}: accuracy on the shards {acc:.3f}", flush=True)


if __name__ == "__main__":
    main()
