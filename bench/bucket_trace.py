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
the later steps, timed once every way is traced, in rotating blocks of all six, so that
the machine's drift lands on every way alike. Its target is the later steps' ratio,
buckets over one request (the median of the blocks' ratios). The first steps here are
each traced beside the earlier ways' models and graphs, which slows tracing (up to three
times a fresh process's time at 1000 variables): bench/bucket_trace_first.py times each way's
first step in a job of its own (``--only``) and prints those ratios.

    horolite-run -np 2 python bench/bucket_trace.py                 # 300 variables
    horolite-run -np 2 python bench/bucket_trace.py --variables 1000
    horolite-run -np 2 python bench/bucket_trace.py --model resnet50   # keras.applications

With ``--model resnet50`` the model is ``keras.applications.ResNet50(weights=None)`` on
64 x 64 images (batch 8, 10 classes): its 214 trainable variables and 94 MB of gradients
in the layer shapes of the real thing, at a size two cores can step.
"""
from __future__ import annotations

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import Target, finish, parser, polite_barrier  # noqa: E402

WIDTH, BATCH = 64, 64
IMAGE, IMAGE_BATCH, CLASSES = 64, 8, 10
MODES = ("plain", "one", "buckets")


def arguments():
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--variables", type=int, default=300,
                   help="trainable variables of the model (two per Dense layer; default 300)")
    p.add_argument("--model", choices=("dense", "resnet50"), default="dense",
                   help="dense: Dense(64) layers (--variables); resnet50: keras.applications")
    p.add_argument("--steps", type=int, default=40, help="later steps timed per way (default 40)")
    p.add_argument("--blocks", type=int, default=4,
                   help="rotating blocks the later steps are timed in (default 4)")
    p.add_argument("--only", default=None, metavar="HOW:WAY",
                   help="time only this way's first step (fit or tape : buckets, one or plain), "
                        "as bench/bucket_trace_first.py runs each in a job of its own")
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
    dense_data = (rng.normal(size=(BATCH, WIDTH)).astype(np.float32),
                  rng.normal(size=(BATCH, WIDTH)).astype(np.float32))
    image_data = (rng.normal(size=(IMAGE_BATCH, IMAGE, IMAGE, 3)).astype(np.float32),
                  np.eye(CLASSES, dtype=np.float32)[rng.randint(0, CLASSES, IMAGE_BATCH)])
    resnet = args.model == "resnet50"

    def model(n):
        """n Dense layers, or (n None) the ResNet-50; with the data it trains on."""
        keras.utils.set_random_seed(1)
        if n is None:
            return keras.applications.ResNet50(weights=None, input_shape=(IMAGE, IMAGE, 3),
                                               classes=CLASSES), image_data
        return keras.Sequential([keras.Input((WIDTH,))] +
                                [keras.layers.Dense(WIDTH, activation="tanh")
                                 for _ in range(n)]), dense_data

    def slowest(seconds: float) -> float:
        return comm.allreduce(seconds, op=MPI.MAX)

    def fit_way(mode, n):
        """(first step's seconds, a function timing k later steps: their median) of fit."""
        m, (x, y) = model(n)
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
        m.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
        first = slowest(time.perf_counter() - t0)
        data = tf.data.Dataset.from_tensors((x, y)).repeat()

        def later(k):
            times.clear()
            polite_barrier(comm)
            m.fit(data, steps_per_epoch=k + 1, epochs=1, shuffle=False, verbose=0,
                  callbacks=[Clock()])
            return slowest(float(np.median(np.diff(times))))  # (steps after fit's first)
        return first, later

    def tape_way(mode, n):
        """The same for a tf.function step with GradientTape and Adam."""
        m, (x, y) = model(n)
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

        def later(k):
            steps = []
            for _ in range(k):
                polite_barrier(comm)
                t0 = time.perf_counter()
                step().numpy()
                steps.append(slowest(time.perf_counter() - t0))
            return float(np.median(steps))
        return first, later

    ways = {"fit": fit_way, "tape": tape_way}
    chosen = [(how, mode) for how in ways for mode in MODES]
    if args.only:
        chosen = [tuple(args.only.split(":"))]
        if chosen[0] not in [(h, m) for h in ways for m in MODES]:
            raise SystemExit(f"--only {args.only}: not one of fit or tape : {', '.join(MODES)}")
    for how, mode in chosen if not args.tiny else ():  # one-time costs first
        ways[how](mode, 2)[1](1)
    if resnet:
        layers = None
    sizes = [4 * int(np.prod(v.shape)) for v in model(layers)[0].trainable_variables]
    requests = len(buckets.plan(sizes, buckets.bucket_cap_bytes()))
    results, rows, timers = {}, [], {}
    for how, mode in chosen:
        first, timers[how, mode] = ways[how](mode, layers)
        results[f"{how}_{mode}"] = {"first_s": first}
        if rank == 0:
            print(f"[bucket_trace] {how} {mode}: first step {first:.2f} s", flush=True)
    payload = {"model": args.model, "variables": len(sizes), "layers": layers,
               "width": None if resnet else WIDTH, "batch": IMAGE_BATCH if resnet else BATCH,
               "requests_per_step_with_buckets": requests, "results": results}
    if args.only:
        finish(comm, args, "bucket_trace_only", payload, ["how", "way", "first step (s)"],
               [[how, mode, f"{results[f'{how}_{mode}']['first_s']:.2f}"]], [])
        return
    # The later steps in rotating blocks of every way, so that the machine's drift over
    # the run lands on every way alike; each ratio is the median of its blocks' ratios.
    blocks = 1 if args.tiny else max(1, args.blocks)
    per_block = max(2, args.steps // blocks)
    samples = {key: [] for key in timers}
    for b in range(blocks):
        for how in ("fit", "tape"):
            for mode in MODES[b % 3:] + MODES[:b % 3]:
                samples[how, mode].append(timers[how, mode](per_block))
    for (how, mode), got in samples.items():
        results[f"{how}_{mode}"]["later_s"] = later = float(np.median(got))
        results[f"{how}_{mode}"]["later_blocks_s"] = got
        rows.append([how, mode, f"{results[f'{how}_{mode}']['first_s']:.2f}",
                     f"{1e3 * later:.1f}"])
    targets = []
    for how in ("fit", "tape"):
        b, o = (results[f"{how}_{m}"] for m in ("buckets", "one"))
        ratios = {"later_buckets_over_one": float(np.median(
                      [x / y for x, y in zip(b["later_blocks_s"], o["later_blocks_s"])]))}
        results[f"{how}_ratios"] = ratios
        targets.append(Target(
            f"{how}: later steps, buckets over num_groups=1", ratios["later_buckets_over_one"],
            1.05, "x", False, "one background cycle per bucket, with no overlap on one host"))
    name = ("bucket_trace_resnet50" if resnet else
            "bucket_trace" if args.tiny or len(sizes) == 300 else f"bucket_trace_{len(sizes)}")
    finish(comm, args, name, payload, ["how", "way", "first step (s)", "later step (ms)"],
           rows, targets)


if __name__ == "__main__":
    main()
