"""Synthetic benchmark: a real Keras model on random images, DistributedGradientTape
inside tf.function; prints images/sec per rank and in total.

    horolite-run -np 2 python examples/tensorflow2_synthetic_benchmark.py [--model ResNet50]
"""
import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import tensorflow as tf

import horolite.tensorflow as hvd


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="MobileNetV2", help="a tf.keras.applications model name")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=16, help="images per rank per step")
    p.add_argument("--num-warmup-batches", type=int, default=1)
    p.add_argument("--num-batches-per-iter", type=int, default=3)
    p.add_argument("--num-iters", type=int, default=3)
    p.add_argument("--fp16-allreduce", action="store_true", help="compress gradients to float16")
    return p.parse_args()


def main():
    args = parse_args()
    hvd.init()
    model = getattr(tf.keras.applications, args.model)(
        weights=None, input_shape=(args.image_size, args.image_size, 3), classes=100)
    opt = tf.keras.optimizers.SGD(0.01 * hvd.size())
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy()
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    rng = np.random.RandomState(hvd.rank())
    data = tf.constant(rng.uniform(size=(args.batch_size, args.image_size, args.image_size, 3)).astype(np.float32))
    target = tf.constant(rng.randint(0, 100, size=(args.batch_size,)))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(target, model(data, training=True))
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    def log(msg):
        if hvd.rank() == 0:
            print(msg, flush=True)

    log(f"model {args.model}, {len(model.trainable_variables)} gradient tensors, "
        f"batch {args.batch_size} per rank, {hvd.size()} ranks")
    step()  # the first step builds the optimizer's variables
    hvd.broadcast_variables(model.variables + opt.variables, root_rank=0)
    for _ in range(args.num_warmup_batches):
        step()
    rates = []
    for i in range(args.num_iters):
        start = time.time()
        for _ in range(args.num_batches_per_iter):
            step()
        rate = args.batch_size * args.num_batches_per_iter / (time.time() - start)
        log(f"iter #{i}: {rate:.1f} img/sec per rank")
        rates.append(rate)
    mean, conf = np.mean(rates), 1.96 * np.std(rates)
    log(f"img/sec per rank: {mean:.1f} +-{conf:.1f}")
    log(f"total img/sec on {hvd.size()} rank(s): {hvd.size() * mean:.1f} +-{hvd.size() * conf:.1f}")


if __name__ == "__main__":
    main()
