"""What gradient buckets cost a model with many variables: the first step and the later ones.

Run under ``horolite-run -np 2``. By default the two ranks pretend to be on two hosts
(HOROLITE_TEST_HOST_IDENTITY=1+1), where buckets are on as across hosts; the exchange
is still shared memory on the same cores, so nothing can overlap and buckets can only
cost. A Keras model of Dense(64) layers (--variables, two per layer) with Adam is
trained three ways, each on a fresh model in this process:

- buckets: the default DistributedOptimizer / DistributedGradientTape;
- one: the same with ``num_groups=1`` (one request per step);
- plain: the same model without horolite (both ranks computing at once);

for Keras ``fit`` and for a ``tf.function`` tape step. It prints the first step (trace,
instantiation and the first negotiation included; the slowest rank's) and the median of
the later steps, and the ratios the issue sets targets for: buckets over one request,
either over plain, and later steps buckets over one request.

    horolite-run -np 2 python bench/bucket_trace.py                 # 300 variables
    horolite-run -np 2 python bench/bucket_trace.py --variables 1000
"""
from __future__ import annotations

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import Target, finish, parser, polite_barrier  # noqa: E402

WIDTH, BATCH = 64, 64
MODES = ("plain", "one", "buckets")


def arguments():
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--variables", type=int, default=300,
                   help="trainable variables of the model (two per Dense layer; default 300)")
    p.add_argument("--steps", type=int, default=20, help="later steps timed per way (default 20)")
    p.add_argument("--pretend-hosts", default="1+1",
                   help="HOROLITE_TEST_HOST_IDENTITY for the ranks (default 1+1: buckets on as "
                        "across hosts); '' to leave the topology alone")
    args = p.parse_args()
    if args.tiny:
        args.variables, args.steps = min(args.variables, 8), 2
    return args


def main():
    args = arguments()
    if args.pretend_hosts:
        os.environ.setdefault("HOROLITE_TEST_HOST_IDENTITY", args.pretend_hosts)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf
    import keras
    from mpi4py import MPI
    import horolite.tensorflow as hvd
    import horolite.tensorflow.keras as hvd_keras
    from horolite.api import buckets

    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    hvd.init()
    comm = MPI.COMM_WORLD
    rank = hvd.rank()
    layers = max(1, args.variables // 2)
    rng = np.random.RandomState(rank)
    x = rng.normal(size=(BATCH, WIDTH)).astype(np.float32)
    y = rng.normal(size=(BATCH, WIDTH)).astype(np.float32)

    def model(n):
        keras.utils.set_random_seed(1)
        return keras.Sequential([keras.Input((WIDTH,))] +
                                [keras.layers.Dense(WIDTH, activation="tanh") for _ in range(n)])

    def slowest(seconds: float) -> float:
        return comm.allreduce(seconds, op=MPI.MAX)

    def fit_way(mode, n):
        """(first step's seconds, the later steps' median seconds) of Keras fit."""
        m = model(n)
        opt = keras.optimizers.Adam(1e-3)
        if mode != "plain":
            opt = hvd_keras.DistributedOptimizer(opt, num_groups=1 if mode == "one" else None)
        m.compile(optimizer=opt, loss=keras.losses.MeanSquaredError())
        times = []

        class Clock(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                times.append(time.perf_counter())
        polite_barrier(comm)
        t0 = time.perf_counter()
        m.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        first = slowest(time.perf_counter() - t0)
        polite_barrier(comm)
        data = tf.data.Dataset.from_tensors((x, y)).repeat()
        m.fit(data, steps_per_epoch=args.steps + 1, epochs=1, shuffle=False, verbose=0,
              callbacks=[Clock()])
        later = float(np.median(np.diff(times)))  # steps after the first of this fit
        return first, slowest(later)

    def tape_way(mode, n):
        """The same for a tf.function step with GradientTape and Adam."""
        m = model(n)
        opt = keras.optimizers.Adam(1e-3)
        xs, ys = tf.constant(x), tf.constant(y)

        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(m(xs, training=True) - ys))
            if mode != "plain":
                tape = hvd.DistributedGradientTape(tape, num_groups=1 if mode == "one" else None)
            opt.apply_gradients(zip(tape.gradient(loss, m.trainable_variables),
                                    m.trainable_variables))
            return loss
        polite_barrier(comm)
        t0 = time.perf_counter()
        step().numpy()
        first = slowest(time.perf_counter() - t0)
        later = []
        for _ in range(args.steps):
            polite_barrier(comm)
            t0 = time.perf_counter()
            step().numpy()
            later.append(slowest(time.perf_counter() - t0))
        return first, float(np.median(later))

    for way in (fit_way, tape_way) if not args.tiny else ():  # one-time costs first
        for mode in MODES:
            way(mode, 2)
    sizes = [WIDTH * WIDTH * 4, WIDTH * 4] * layers
    requests = len(buckets.plan(sizes, buckets.bucket_cap_bytes()))
    results, rows = {}, []
    for how, way in (("fit", fit_way), ("tape", tape_way)):
        for mode in MODES:
            first, later = way(mode, layers)
            results[f"{how}_{mode}"] = {"first_s": first, "later_s": later}
            rows.append([how, mode, f"{first:.2f}", f"{1e3 * later:.1f}"])
            if rank == 0:
                print(f"[bucket_trace] {how} {mode}: first step {first:.2f} s, later "
                      f"{1e3 * later:.1f} ms", flush=True)
    targets = []
    for how in ("fit", "tape"):
        b, o, p = (results[f"{how}_{m}"] for m in ("buckets", "one", "plain"))
        ratios = {"first_buckets_over_one": b["first_s"] / o["first_s"],
                  "first_either_over_plain": max(b["first_s"], o["first_s"]) / p["first_s"],
                  "later_buckets_over_one": b["later_s"] / o["later_s"]}
        results[f"{how}_ratios"] = ratios
        targets += [
            Target(f"{how}: first step, buckets over num_groups=1", ratios["first_buckets_over_one"],
                   1.2, "x", False, "tracing and instantiating a graph of one enqueue and wait "
                   "per bucket, and the barrier's ops"),
            Target(f"{how}: first step, either over plain Keras", ratios["first_either_over_plain"],
                   1.3, "x", False, "horolite's ops in the graph, the first negotiation"),
            Target(f"{how}: later steps, buckets over num_groups=1",
                   ratios["later_buckets_over_one"], 1.05, "x", False,
                   "one background cycle per bucket, with no overlap on one host"),
        ]
    payload = {"variables": 2 * layers, "layers": layers, "width": WIDTH, "batch": BATCH,
               "requests_per_step_with_buckets": requests, "results": results}
    finish(comm, args, "bucket_trace", payload, ["how", "way", "first step (s)", "later step (ms)"],
           rows, targets)


if __name__ == "__main__":
    main()
