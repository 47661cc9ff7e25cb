"""The job world without MPI (horolite-run --gloo) against the MPI world (horolite-run over
mpirun), in one run on one host: init()'s set-up time, a 4 KiB and a 64 MiB allreduce, and
with --steps the NumPy ResNet-50 step (its 161 gradients as one grouped allreduce) and a
TensorFlow step (bench/step_tf.py's 100 x Dense(500) model) with DistributedGradientTape in
tf.function and with Keras fit and DistributedOptimizer.

    python bench/world_compare.py [--np 2 3 4] [--rounds 3]
    python bench/world_compare.py --np 16 --pretend-hosts --iters 10   # set-up across 16 hosts
    python bench/world_compare.py --hosts 2x2 --steps    # as root: simulated hosts, 1 Gbit/s

Each round starts one job in each world per rank count, alternating, and each job's
ranks time the same allreduces (the median of many, the slowest rank's) and when init()
returned after the last rank's process started. It prints gloo/MPI ratios: targets are
<= 1.0 for both allreduces (issue 59) and set-up within 1 s of the last rank's start
(its import of horolite included; the last rank's call to init() to its return beside it).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

BORN = time.time()  # (this process's start, as near as Python allows)

MiB = 1 << 20


def rank_side(outdir: str, iters: int, steps: bool = False) -> None:
    import numpy as np
    import horolite as hvd
    called = time.time()
    hvd.init()
    ready = time.time()
    r = hvd.rank()
    out = {"born": BORN, "called": called, "ready": ready}
    for label, nbytes, n in (("4KiB", 4096, iters * 10), ("64MiB", 64 * MiB, max(3, iters // 4))):
        x = np.ones(nbytes // 4, dtype=np.float32)
        for _ in range(3):
            hvd.allreduce(x, name=label, op=hvd.Sum)
        times = []
        for _ in range(n):
            t = time.perf_counter()
            hvd.allreduce(x, name=label, op=hvd.Sum)
            times.append(time.perf_counter() - t)
        out[label] = statistics.median(times)
    if steps:
        out.update(step_times(hvd, r, iters))
    with open(os.path.join(outdir, f"rank.{r}.json"), "w") as f:
        json.dump(out, f)


def _median_of(fn, n: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def step_times(hvd, rank: int, iters: int) -> dict:
    """The ResNet-50 NumPy step, and the TensorFlow tape and fit steps (one thread each)."""
    import numpy as np
    import step_models
    grads = [np.full(s, rank + 1.0, np.float32) for s in step_models.resnet50()]
    out = {"resnet50": _median_of(lambda: hvd.grouped_allreduce(grads, name="resnet50"),
                                  max(4, iters // 10))}
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf
    import horolite.keras as hk
    import horolite.tensorflow as htf
    from step_tf import BATCH, CLASSES, DEPTH, WIDTH
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    rng = np.random.default_rng(rank)
    x = rng.standard_normal((BATCH, WIDTH)).astype(np.float32)
    y = rng.integers(0, CLASSES, BATCH)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def model():
        return tf.keras.Sequential([tf.keras.Input((WIDTH,))] + [
            tf.keras.layers.Dense(WIDTH, activation="relu") for _ in range(DEPTH)] + [
            tf.keras.layers.Dense(CLASSES)])
    net, opt = model(), tf.keras.optimizers.SGD(0.001)

    @tf.function
    def tape_step():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, net(x, training=True))
        tape = htf.DistributedGradientTape(tape)
        opt.apply_gradients(zip(tape.gradient(loss, net.trainable_variables),
                                net.trainable_variables))
    out["tape"] = _median_of(tape_step, max(4, iters // 10))
    fitted = model()
    fitted.compile(optimizer=hk.DistributedOptimizer(tf.keras.optimizers.SGD(0.001)),
                   loss=loss_fn)
    batches = max(4, iters // 10)
    data = tf.data.Dataset.from_tensor_slices((np.tile(x, (batches, 1)),
                                               np.tile(y, batches))).batch(BATCH)
    fitted.fit(data, epochs=1, verbose=0)  # (the first trace)
    t = time.perf_counter()
    fitted.fit(data, epochs=1, verbose=0)
    out["fit"] = (time.perf_counter() - t) / batches
    return out


def bed_hosts(hosts: int, per: int) -> str:
    """`-H` for `hosts` simulated hosts of `per` ranks: (2, 2) -> "hl-a:2,hl-b:2"."""
    return ",".join(f"hl-{chr(ord('a') + i)}:{per}" for i in range(hosts))


def one_job(world: str, np_: int, iters: int, pretend: bool = False, steps: bool = False,
            bed=None, hosts: str = "") -> dict:
    from common import horolite_run
    run = horolite_run()
    outdir = tempfile.mkdtemp(prefix="world-compare-")
    where = ["-H", hosts] if bed is not None else ["-np", str(np_)]
    cmd = [run] + (["--gloo"] if world == "gloo" else []) + where + [
        sys.executable, os.path.abspath(__file__), "--rank-side", outdir,
        "--iters", str(iters)] + (["--steps"] if steps else [])
    env = dict(os.environ)
    if pretend:  # every rank a host of its own: the set-up of a job across np hosts
        env["HOROLITE_TEST_HOST_IDENTITY"] = "+".join(["1"] * np_)
    if bed is None:
        subprocess.run(cmd, check=True, capture_output=True, timeout=600, env=env)
    else:  # (the simulated hosts share this machine's files and clock)
        proc = bed.run(cmd, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {proc.returncode}:\n"
                               f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    ranks = [json.load(open(os.path.join(outdir, f"rank.{q}.json"))) for q in range(np_)]
    shutil.rmtree(outdir, ignore_errors=True)
    slowest = {k: max(x[k] for x in ranks) for k in ("resnet50", "tape", "fit") if k in ranks[0]}
    return {**slowest, "setup": max(x["ready"] for x in ranks) - max(x["born"] for x in ranks),
            "init": max(x["ready"] for x in ranks) - max(x["called"] for x in ranks),
            "4KiB": max(x["4KiB"] for x in ranks), "64MiB": max(x["64MiB"] for x in ranks)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--rank-side", metavar="OUTDIR", help=argparse.SUPPRESS)
    p.add_argument("--pretend-hosts", action="store_true",
                   help="each rank on a host of its own (HOROLITE_TEST_HOST_IDENTITY=1+1+...)")
    p.add_argument("--steps", action="store_true",
                   help="also the NumPy ResNet-50 step and TensorFlow's tape and fit steps")
    p.add_argument("--tiny", action="store_true", help="one short round (the suite's smoke run)")
    p.add_argument("--hosts", metavar="HOSTSxRANKS",
                   help="run every job across simulated hosts (as root; tests/multihost/bed.py), "
                        "e.g. 2x2, instead of --np on this host")
    p.add_argument("--rate", default="1gbit", help="with --hosts: every link's rate (tc tbf)")
    args = p.parse_args(argv)
    if args.rank_side:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (step_models, step_tf)
        rank_side(args.rank_side, args.iters, args.steps)
        return
    if args.tiny:
        args.np, args.rounds, args.iters = [2], 1, 8
    with contextlib.ExitStack() as stack:
        bed, on = None, ""
        if args.hosts:
            from common import simulated_hosts
            hosts, per = (int(n) for n in args.hosts.split("x"))
            args.np, on = [hosts * per], bed_hosts(hosts, per)
            bed = stack.enter_context(simulated_hosts(hosts, args.rate, "world_compare"))
            print(f"{args.hosts} simulated hosts, links at {args.rate}")
        seen = {(w, n): [] for w in ("mpi", "gloo") for n in args.np}
        for _ in range(args.rounds):
            for n in args.np:
                for world in ("mpi", "gloo"):
                    seen[world, n].append(one_job(world, n, args.iters, args.pretend_hosts,
                                                  args.steps, bed, on))
    print("| np | measure | MPI world | without MPI | ratio | target |")
    print("|---|---|---|---|---|---|")
    for n in args.np:
        keys = [("4KiB", "ms", 1e3), ("64MiB", "ms", 1e3), ("setup", "s", 1), ("init", "s", 1)]
        if args.steps:
            keys += [("resnet50", "ms", 1e3), ("tape", "ms", 1e3), ("fit", "ms", 1e3)]
        for key, unit, scale in keys:
            mpi = statistics.median(x[key] for x in seen["mpi", n])
            gloo = statistics.median(x[key] for x in seen["gloo", n])
            target = "<= 1 s" if key == "setup" else "ratio <= 1.0"
            met = gloo <= 1.0 if key == "setup" else gloo <= mpi
            label = {"setup": "init() returns, after the last rank's start",
                     "init": "init() returns, after the last rank's call",
                     "resnet50": "ResNet-50 NumPy step (grouped)",
                     "tape": "TF tape step (tf.function)",
                     "fit": "Keras fit, per batch"}.get(key, key)
            print(f"| {n} | {label} | "
                  f"{mpi * scale:.3f} {unit} | {gloo * scale:.3f} {unit} | {gloo / mpi:.2f} | "
                  f"{target}: {'met' if met else 'missed'} |")


if __name__ == "__main__":
    main()
