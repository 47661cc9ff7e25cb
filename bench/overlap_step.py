"""A TensorFlow step across hosts: does the exchange hide behind backprop?

Run as root: the script builds two simulated hosts (tests/multihost/bed.py), caps
each link at --rate with tc tbf, and runs itself with ``horolite-run -H
hl-a:1,hl-b:1`` (``--local``: ``horolite-run -np 2`` on this machine instead, no bed).
Each rank runs one TensorFlow thread (intra and inter op). For each model it
measures, in alternating blocks of one job (medians of the slowest rank's step):

- plain: the step without any exchange (both ranks computing at once);
- forward: its forward pass alone (no bucket can leave before backprop starts, so no
  step can take less than max(plain, forward + exchange): the bound printed);
- exchange: one grouped allreduce of tensors shaped like the step's gradients;
- tape: ``DistributedGradientTape`` in a ``tf.function``, the default bucketing;
- tape_one_group: the same with every gradient in one request (``num_groups=1``);
- fit / fit_plain: Keras ``fit`` with and without ``hvd.DistributedOptimizer``;
- tape_inline / fit_inline: tape and fit with the exchange lane off (where the
  ranks span hosts: agreed allreduces then run on the background thread);
- tape_no_barrier / fit_no_barrier (``--barrier-cost``): tape and fit traced without the
  barrier that holds a step's whole update until its last bucket is back (what keeps
  every rank's weights equal after a failed step): what that guarantee costs, since
  without it each bucket's share of the update can run while later buckets travel.

and prints each step over max(plain, exchange): 1.0 is perfect overlap, about
1 + min/max when nothing overlaps.

    python bench/overlap_step.py                      # as root; the issue's four models
    python bench/overlap_step.py --local --models 100x500:256
    python bench/overlap_step.py --models 40x256:512 --optimizer adam --barrier-cost
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# layers x width : batch (a Dense(width) input, then `layers` Dense(width, relu), Dense(10))
MODELS = ["40x256:512", "40x256:2048", "40x256:128", "12x1024:256"]


def _parse_model(spec: str):
    shape, batch = spec.split(":")
    layers, width = shape.split("x")
    return int(layers), int(width), int(batch)


# ---- rank side ----

def worker(args) -> None:
    import numpy as np
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras
    from mpi4py import MPI

    sys.path.insert(0, HERE)
    import horolite.tensorflow as hvd
    from tf_steps import step_functions
    import horolite.tensorflow.keras as hvd_keras
    from horolite.runtime import registry
    from common import interleaved_median_times

    hvd.init()
    comm = MPI.COMM_WORLD
    rows = []
    for spec in args.models:
        layers, width, batch = _parse_model(spec)

        def build():
            keras.utils.set_random_seed(1)
            return keras.Sequential([keras.Input((width,))] +
                                    [keras.layers.Dense(width, activation="relu")
                                     for _ in range(layers)] + [keras.layers.Dense(10)])

        rng = np.random.default_rng(hvd.rank())
        x = tf.constant(rng.standard_normal((batch, width)).astype(np.float32))
        y = tf.constant(rng.integers(0, 10, batch))
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model = build()
        opt = _optimizer(keras, args)

        step_fn, exchange = step_functions(model, x, y, loss_fn, opt, hvd, "overlap_bench.exchange")

        @tf.function
        def forward():
            return loss_fn(y, model(x, training=True))

        rt = registry.current()

        def inline(fn):
            """fn with the exchange lane off: agreed allreduces on the background thread."""
            def run():
                rt.pipelined = False
                try:
                    return fn()
                finally:
                    rt.pipelined = True
            return run

        tape_fn = step_fn(lambda t: hvd.DistributedGradientTape(t))
        fns = {"plain": step_fn(None),
               "forward": forward,
               "exchange": exchange,
               "tape": tape_fn,
               "tape_one_group": step_fn(lambda t: hvd.DistributedGradientTape(t, num_groups=1))}
        if rt.lane is not None:
            fns["tape_inline"] = inline(tape_fn)
        if args.barrier_cost:
            fns["tape_no_barrier"] = without_barrier(
                step_fn(lambda t: hvd.DistributedGradientTape(t)))
        times = interleaved_median_times({k: (lambda f=f: f().numpy()) for k, f in fns.items()},
                                         args.iters, blocks=args.blocks, warmup=args.warmup,
                                         comm=comm)
        times.update(_fit_times(keras, hvd_keras, build, x, y, args, comm, np, rt))
        nbytes = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
        rows.append({"model": spec, "gradients": len(model.trainable_variables),
                     "bytes": nbytes, **{f"{k}_s": v for k, v in times.items()}})
    if comm.Get_rank() == 0:
        print("RESULT " + json.dumps({"ranks": comm.Get_size(), "rows": rows}), flush=True)
    hvd.shutdown()


def _optimizer(keras, args):
    return (keras.optimizers.Adam(1e-4) if args.optimizer == "adam"
            else keras.optimizers.SGD(1e-4))


def without_barrier(fn):
    """fn, traced (on its first call) without the barrier that makes a step's reduced
    gradients, and so its whole update, wait for its last request: each bucket's share of
    the update can then start while later buckets travel. For measuring only: a step that
    fails on one rank may then leave the ranks' weights unequal."""
    from horolite.tensorflow import gradients

    def run(*args, **kwargs):
        kept = gradients._after_every_request
        gradients._after_every_request = lambda *a: None
        try:
            return fn(*args, **kwargs)
        finally:
            gradients._after_every_request = kept
    return run


def _fit_times(keras, hvd_keras, build, x, y, args, comm, np, rt) -> dict:
    """Median of the slowest rank's fit step (time between batch ends), plain and wrapped
    (and wrapped with the exchange lane off, where there is one), in alternating blocks."""
    class Timer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.ends = []

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter())

    models = {}
    kinds = [("fit_plain", None), ("fit", hvd_keras.DistributedOptimizer)]
    if rt.lane is not None:
        kinds.append(("fit_inline", hvd_keras.DistributedOptimizer))
    if args.barrier_cost:
        kinds.append(("fit_no_barrier", hvd_keras.DistributedOptimizer))
    for name, wrap in kinds:
        model = build()
        opt = _optimizer(keras, args)
        model.compile(optimizer=opt if wrap is None else wrap(opt),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        models[name] = model
    import tensorflow as tf
    data = tf.data.Dataset.from_tensors((x, y)).repeat()
    per = max(2, -(-args.iters // args.blocks))
    times = {name: [] for name in models}
    for _ in range(args.blocks):
        for name, model in models.items():
            timer = Timer()
            comm.Barrier()
            rt.pipelined = name != "fit_inline"
            fit = model.fit if name != "fit_no_barrier" else without_barrier(model.fit)
            fit(data, epochs=1, steps_per_epoch=per + args.warmup + 1, verbose=0,
                callbacks=[timer])
            rt.pipelined = True
            steps = np.diff(np.array(timer.ends[args.warmup:]))
            slowest = np.empty_like(steps)
            comm.Allreduce(steps, slowest, op=_mpi_max())
            times[name].append(slowest)
    return {name: float(np.median(np.concatenate(t))) for name, t in times.items()}


def _mpi_max():
    from mpi4py import MPI
    return MPI.MAX


# ---- driver ----

def _paired(rows, suffix: str, key: str, label: str, ratio: str) -> list:
    """A table of tape and fit as run and as run with `suffix` (the same job's blocks);
    each row gains "{key}_tape_ratio" and "{key}_fit_ratio" (as run / with `suffix`)."""
    rows = [row for row in rows if f"tape_{suffix}_s" in row]
    if not rows:
        return []
    lines = ["", f"| model | tape ms | tape, {label} ms | fit ms | fit, {label} ms | "
             f"tape: {ratio} | fit: {ratio} |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        cells = [row["model"]]
        for way in ("tape", "fit"):
            row[f"{key}_{way}_ratio"] = row[f"{way}_s"] / row[f"{way}_{suffix}_s"]
            cells += [f"{1e3 * row[f'{way}_s']:.1f}", f"{1e3 * row[f'{way}_{suffix}_s']:.1f}"]
        cells += [f"{row[f'{key}_tape_ratio']:.3f}", f"{row[f'{key}_fit_ratio']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def report(doc: dict, args) -> str:
    sys.path.insert(0, HERE)
    from common import Target
    lines = ["| model | gradients | MiB | plain ms | forward ms | exchange ms | tape ms | one group ms | "
             "fit plain ms | fit ms | tape / max | one group / max | fit / max(fit plain, exchange) "
             "| bound / max |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    targets = []
    for row in doc["rows"]:
        ms = {k[:-2]: 1e3 * v for k, v in row.items() if k.endswith("_s")}
        top = max(ms["plain"], ms["exchange"])
        fit_top = max(ms["fit_plain"], ms["exchange"])
        row["tape_over_max"] = ms["tape"] / top
        row["one_group_over_max"] = ms["tape_one_group"] / top
        row["fit_over_max"] = ms["fit"] / fit_top
        row["bound_over_max"] = max(ms["plain"], ms["forward"] + ms["exchange"]) / top
        lines.append(f"| {row['model']} | {row['gradients']} | {row['bytes'] / 2**20:.1f} | "
                     f"{ms['plain']:.0f} | {ms['forward']:.0f} | {ms['exchange']:.0f} | "
                     f"{ms['tape']:.0f} | "
                     f"{ms['tape_one_group']:.0f} | {ms['fit_plain']:.0f} | {ms['fit']:.0f} | "
                     f"{row['tape_over_max']:.2f} | {row['one_group_over_max']:.2f} | "
                     f"{row['fit_over_max']:.2f} | {row['bound_over_max']:.2f} |")
        if not args.local:
            limit = (f"no bucket leaves before backprop starts: the step is at least "
                     f"max(plain, forward + exchange) = {row['bound_over_max']:.2f} x; the "
                     "rest: the exchange's CPU work slows backprop on the shared cores, and "
                     "each bucket waits for the slower rank's copy")
            targets.append(Target(f"{row['model']}: tape / max(plain, exchange)",
                                  row["tape_over_max"], 1.15, "x", False, limit))
            targets.append(Target(f"{row['model']}: fit / max(fit plain, exchange)",
                                  row["fit_over_max"], 1.15, "x", False, limit))
    lines += _paired(doc["rows"], "no_barrier", "barrier", "no barrier", "barrier / none")
    lines += _paired(doc["rows"], "inline", "lane", "lane off", "on / off")
    lines.append("")
    if targets:
        lines += ["| target | value | bound | met | what limits it |", "|---|---|---|---|---|"]
        for t in targets:
            met = {True: "met", False: "**missed**", None: "not measured"}[t.met]
            lines.append(f"| {t.name} | {t.value:.2f} | <= {t.bound:g} | {met} | "
                         f"{t.limited_by} |")
        doc["targets"] = [t.as_dict() for t in targets]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--models", type=lambda s: s.split(","), default=MODELS)
    p.add_argument("--local", action="store_true",
                   help="2 ranks on this machine (horolite-run -np 2), no simulated hosts")
    p.add_argument("--rate", default="1gbit", help="tc tbf rate of every link")
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=None)
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    p.add_argument("--barrier-cost", action="store_true",
                   help="also time tape and fit traced without the update barrier")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable for the ranks (repeatable)")
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    run = os.path.join(os.path.dirname(sys.executable), "horolite-run")
    work = [sys.executable, os.path.abspath(__file__), "--worker", "--models", ",".join(args.models),
            "--iters", str(args.iters), "--blocks", str(args.blocks), "--warmup", str(args.warmup),
            "--optimizer", args.optimizer] + (["--barrier-cost"] if args.barrier_cost else [])
    env = dict(os.environ, **dict(e.split("=", 1) for e in args.env))
    started = time.time()
    if args.local:
        import subprocess
        proc = subprocess.run([run, "-np", "2"] + work, capture_output=True, text=True,
                              timeout=3600, env=env)
    else:
        sys.path.insert(0, HERE)
        from common import simulated_hosts
        with simulated_hosts(2, args.rate, "overlap_step") as bed:
            proc = bed.run([run, "-H", "hl-a:1,hl-b:1"] + work, timeout=3600,
                           env=dict(e.split("=", 1) for e in args.env) or None)
    result = None
    for line in proc.stdout.splitlines():
        if "RESULT " in line:
            result = json.loads(line.split("RESULT ", 1)[1])
    if result is None:
        print(f"run failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}",
              file=sys.stderr)
        return 1
    doc = {"benchmark": "overlap_step", "where": "np 2, one host" if args.local else
           f"2 simulated hosts x 1 rank, links at {args.rate}",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "load_average": os.getloadavg(), "wall_seconds": round(time.time() - started, 1),
           "settings": args.env, "optimizer": args.optimizer, **result}
    md = report(doc, args)
    out = args.out or os.path.join(HERE, "results",
                                   "overlap_step_local.json" if args.local else "overlap_step.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    with open(os.path.splitext(out)[0] + ".md", "w") as f:
        f.write(md)
    print(f"{doc['where']}; load average {os.getloadavg()[0]:.1f}\n\n{md}\nwrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
