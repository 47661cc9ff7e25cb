"""Elastic TensorFlow training with a known result (the least squares of elastic_train.py).

--mode tape: a tf.Variable, hvd.DistributedGradientTape and TensorFlowState;
--mode fit:  Keras 3 model.fit with a DistributedOptimizer(SGD), KerasState and the three
             elastic callbacks (commits at epoch ends only: Keras 3 restarts an epoch
             from its first batch).
Writes the same files as elastic_train.py (pid, steps, resumed, final) into OUTDIR.
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from elastic_train import DIM, GLOBAL, LR, batch  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("outdir")
    p.add_argument("--mode", choices=("tape", "fit"), default="tape")
    p.add_argument("--steps", type=int, default=30, help="tape: steps; fit: steps per epoch")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--commit-every", type=int, default=5)
    p.add_argument("--sleep", type=float, default=0.1)
    args = p.parse_args()

    import keras
    import tensorflow as tf
    import horolite.tensorflow.keras as hvd
    keras.config.set_floatx("float64")
    hvd.init()
    gen = os.environ.get("HOROLITE_ELASTIC_GENERATION", "-")
    me = f"{gen}.{hvd.rank()}"
    with open(os.path.join(args.outdir, f"pid.{me}"), "w") as f:
        f.write(str(os.getpid()))
    log = open(os.path.join(args.outdir, f"steps.{me}"), "a")
    resets = []

    def shard(step):
        x, y = batch(step)
        part = slice(hvd.rank() * GLOBAL // hvd.size(), (hvd.rank() + 1) * GLOBAL // hvd.size())
        return x[part], y[part]

    if args.mode == "tape":
        import horolite.tensorflow as htf
        w = tf.Variable(np.zeros(DIM), dtype=tf.float64)
        state = htf.elastic.TensorFlowState([w], step=0)

        @htf.elastic.run
        def train(state):
            with open(os.path.join(args.outdir, f"resumed.{me}"), "w") as f:
                f.write(f"{state.step} {len(resets)}")
            while state.step < args.steps:
                x, y = shard(state.step)
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean((tf.linalg.matvec(x, w) - y) ** 2)
                tape = htf.DistributedGradientTape(tape)
                w.assign_sub(LR * tape.gradient(loss, w))
                state.step += 1
                log.write(f"{gen} {hvd.rank()} {hvd.size()} {state.step} {time.time():.6f}\n")
                log.flush()
                time.sleep(args.sleep)
                if state.step % args.commit_every == 0:
                    state.commit()
        state.register_reset_callbacks([lambda: resets.append(hvd.size())])
        train(state)
        final = w.numpy()
    else:
        model = keras.Sequential([keras.Input((DIM,)), keras.layers.Dense(1, use_bias=False,
                                                                         kernel_initializer="zeros")])
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR)), loss="mse")
        state = hvd.elastic.KerasState(model, batch=0, epoch=0)
        state.register_reset_callbacks([lambda: resets.append(hvd.size())])

        class Log(keras.callbacks.Callback):
            def on_train_batch_end(self, b, logs=None):
                log.write(f"{gen} {hvd.rank()} {hvd.size()} {b} {time.time():.6f}\n")
                log.flush()
                time.sleep(args.sleep)

        callbacks = [hvd.elastic.UpdateEpochStateCallback(state),
                     hvd.elastic.UpdateBatchStateCallback(state),
                     hvd.elastic.CommitStateCallback(state, batches_per_commit=10 ** 6), Log()]
        parts = [shard(s) for s in range(args.steps)]
        x = np.concatenate([a for a, _ in parts])
        y = np.concatenate([b for _, b in parts])[:, None]

        @hvd.elastic.run
        def train(state):
            with open(os.path.join(args.outdir, f"resumed.{me}"), "w") as f:
                f.write(f"{state.epoch} {len(resets)}")
            state.model.fit(x, y, batch_size=GLOBAL // hvd.size(), shuffle=False,
                            epochs=args.epochs - state.epoch, callbacks=callbacks,
                            verbose=0)
        train(state)
        final = model.get_weights()[0][:, 0]
    np.save(os.path.join(args.outdir, f"final.{hvd.rank()}.npy"), final)


if __name__ == "__main__":
    sys.exit(main())
