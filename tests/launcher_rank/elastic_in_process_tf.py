"""Elastic TensorFlow training without MPI whose survivors go on in-process, with a known
result (the least squares of elastic_train.py) and a count of traces.

--mode tape: a tf.function step with hvd.DistributedGradientTape and TensorFlowState; it
             also trains an embedding through tf.gather (IndexedSlices gradients, averaged):
             rank r looks row 0 up r + 1 times (r read in the step by hvd.rank_op()), so
             at n ranks row 0 falls by (n + 1) / 2 a step; the step returns hvd.rank_op()
             and hvd.size_op() as it read them.
--mode fit:  Keras 3 model.fit with a DistributedOptimizer(Adam) (the docs' example: its
             slots exist only once built, and a newcomer's are not), KerasState and the
             three elastic callbacks (commits at epoch ends).
Per worker into OUTDIR: pid.<w>, steps.<w> (``<generation> <rank> <size> <step> <time>``,
and in tape mode the rank and size the traced step read),
resets.<w> (``<generation> <size> <pid>``), traces.<w> (one line per trace of the step),
final.<w>.npy, and final_step.<w> and embedding.<w>.npy (tape: the steps trained, the
embedding) or epochs.<w> (fit: the epochs it trained).
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
    p.add_argument("--steps", type=int, default=60, help="tape: steps; fit: steps per epoch")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--commit-every", type=int, default=3)
    p.add_argument("--sleep", type=float, default=0.05)
    p.add_argument("--until-file", help="every rank stops at the first step (tape) or epoch's "
                                        "end (fit) after it exists")
    p.add_argument("--no-join", action="store_true",
                   help="a worker started to join ends at once (spares the TensorFlow import)")
    args = p.parse_args()
    if args.no_join and os.environ.get("HOROLITE_ELASTIC_JOIN"):
        return

    import keras
    import tensorflow as tf
    import horolite.tensorflow.keras as hvd
    import horolite as core
    import horolite.tensorflow as htf
    from horolite.elastic import in_process
    keras.config.set_floatx("float64")
    hvd.init()
    me = os.environ["HOROLITE_ELASTIC_WORKER"]
    out = lambda name: os.path.join(args.outdir, f"{name}.{me}")  # noqa: E731
    with open(out("pid"), "w") as f:
        f.write(str(os.getpid()))
    log = open(out("steps"), "a")
    traces = open(out("traces"), "a")

    def on_reset():
        with open(out("resets"), "a") as f:
            f.write(f"{in_process.generation()} {hvd.size()} {os.getpid()}\n")

    def shard(step):
        x, y = batch(step)
        part = slice(hvd.rank() * GLOBAL // hvd.size(), (hvd.rank() + 1) * GLOBAL // hvd.size())
        return x[part], y[part]

    def stop_now():  # (every rank stops at the same step)
        seen = np.array([float(bool(args.until_file) and os.path.exists(args.until_file))])
        return core.allreduce(seen, op=core.Max, name="until")[0]

    def logged(step, *traced):
        traces.write(f"step {in_process.generation()}\n")
        log.write(f"{in_process.generation()} {hvd.rank()} {hvd.size()} {step} "
                  f"{time.time():.6f}{''.join(f' {int(t)}' for t in traced)}\n")
        log.flush()

    if args.mode == "tape":
        w = tf.Variable(np.zeros(DIM), dtype=tf.float64)
        emb = tf.Variable(np.zeros((3, 2)), dtype=tf.float64)
        state = htf.elastic.TensorFlowState([w, emb], step=0)

        @tf.function(input_signature=[tf.TensorSpec([None, DIM], tf.float64),
                                      tf.TensorSpec([None], tf.float64)])
        def step(x, y):
            traces.write("trace\n")
            traces.flush()
            rows = tf.zeros([htf.rank_op() + 1], tf.int32)
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((tf.linalg.matvec(x, w) - y) ** 2)
                loss += tf.reduce_sum(tf.gather(emb, rows))
            tape = htf.DistributedGradientTape(tape)
            grad_w, grad_emb = tape.gradient(loss, [w, emb])
            w.assign_sub(LR * grad_w)
            emb.scatter_sub(grad_emb)  # (an IndexedSlices: rows repeat, and add up)
            return htf.rank_op(), htf.size_op()

        @htf.elastic.run
        def train(state):
            while state.step < args.steps:
                traced = step(*shard(state.step))
                state.step += 1
                logged(state.step, *traced)
                time.sleep(args.sleep)
                if state.step % args.commit_every == 0:
                    state.commit()
                if args.until_file and stop_now():
                    break
        state.register_reset_callbacks([on_reset])
        train(state)
        final = w.numpy()
        np.save(out("embedding") + ".npy", emb.numpy())
        with open(out("final_step"), "w") as f:
            f.write(str(state.step))
    else:
        class Traced(keras.layers.Layer):
            def call(self, t):
                if not tf.executing_eagerly():
                    traces.write("trace\n")
                    traces.flush()
                return t

        model = keras.Sequential([keras.Input((DIM,)), Traced(), keras.layers.Dense(
            1, use_bias=False, kernel_initializer="zeros")])
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(LR)), loss="mse")
        state = hvd.elastic.KerasState(model, batch=0, epoch=0)
        state.register_reset_callbacks([on_reset])

        class Log(keras.callbacks.Callback):
            def on_train_batch_end(self, b, logs=None):
                logged(b)
                time.sleep(args.sleep)

        class Until(keras.callbacks.Callback):  # (every rank stops at the same epoch's end)
            def on_epoch_end(self, epoch, logs=None):
                if stop_now():
                    self.model.stop_training = True

        callbacks = [hvd.elastic.UpdateEpochStateCallback(state),
                     hvd.elastic.UpdateBatchStateCallback(state),
                     hvd.elastic.CommitStateCallback(state, batches_per_commit=10 ** 6), Log(),
                     Until()]

        @hvd.elastic.run
        def train(state):
            parts = [shard(s) for s in range(args.steps)]  # (this world's shard)
            x = np.concatenate([a for a, _ in parts])
            y = np.concatenate([b for _, b in parts])[:, None]
            state.model.fit(x, y, batch_size=GLOBAL // hvd.size(), shuffle=False,
                            epochs=args.epochs - state.epoch, callbacks=callbacks,
                            verbose=0)
        train(state)
        final = model.get_weights()[0][:, 0]
        with open(out("epochs"), "w") as f:
            f.write(str(state.epoch))
    np.save(out("final") + ".npy", final)


if __name__ == "__main__":
    sys.exit(main())
