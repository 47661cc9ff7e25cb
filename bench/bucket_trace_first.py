"""The first step of a model with many variables, each way in a job of its own.

A user's first step is traced in a fresh process. Timed in one job after other ways,
a first step is traced beside their models and graphs, and tracing slows as they pile
up (a 1000-variable tape step: about 45 s in a job of its own, up to 145 s as a later
way of one job).
This runs ``horolite-run -np 2 python bench/bucket_trace.py --only HOW:WAY`` once per
way and round, the order of the three ways rotating from round to round, and prints
the issue's first-step ratios from the upper medians over rounds: buckets over
``num_groups=1``, and either over plain Keras, for ``fit`` and for the tape step.

    python bench/bucket_trace_first.py                      # 300 variables
    python bench/bucket_trace_first.py --variables 1000
    python bench/bucket_trace_first.py --model resnet50 --rounds 2
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import Target, finish, horolite_run, parser  # noqa: E402

WAYS = ("buckets", "one", "plain")


def arguments(argv=None):
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--variables", type=int, default=300)
    p.add_argument("--model", choices=("dense", "resnet50"), default="dense")
    p.add_argument("--rounds", type=int, default=1, help="jobs per way (default 1)")
    return p.parse_args(argv)


def one_job(args, how: str, way: str) -> Tuple[float, int]:
    """The slowest rank's first step of `how` `way`, in a job of its own, and the
    model's number of variables."""
    run = horolite_run()
    with tempfile.TemporaryDirectory(prefix="bucket-first-") as tmp:
        out = os.path.join(tmp, "only.json")
        cmd = [run, "-np", "2", sys.executable, os.path.join(HERE, "bucket_trace.py"),
               "--only", f"{how}:{way}", "--variables", str(args.variables),
               "--model", args.model, "--out", out, "--no-plot"] + (["--tiny"] if args.tiny else [])
        env = dict(os.environ)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"{how}:{way} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n"
                               f"{proc.stderr[-3000:]}")
        with open(out) as f:
            doc = json.load(f)
    return doc["results"][f"{how}_{way}"]["first_s"], doc["variables"]


def main(argv=None) -> None:
    args = arguments(argv)
    firsts = {(how, way): [] for how in ("fit", "tape") for way in WAYS}
    variables = None
    for r in range(max(1, args.rounds)):
        order = WAYS[r % 3:] + WAYS[:r % 3]
        for how in ("fit", "tape"):
            for way in order:
                seconds, variables = one_job(args, how, way)
                firsts[how, way].append(seconds)
                print(f"[bucket_trace_first] round {r + 1} {how} {way}: {seconds:.2f} s",
                      flush=True)
    median = {k: sorted(v)[len(v) // 2] for k, v in firsts.items()}
    results, rows, targets = {}, [], []
    for how in ("fit", "tape"):
        b, o, p = (median[how, w] for w in WAYS)
        results[how] = {"first_s": {w: firsts[how, w] for w in WAYS},
                        "buckets_over_one": b / o, "either_over_plain": max(b, o) / p}
        rows += [[how, w, " ".join(f"{s:.1f}" for s in firsts[how, w])] for w in WAYS]
        targets += [
            Target(f"{how}: first step, buckets over num_groups=1", b / o, 1.2, "x", False,
                   "tracing a graph of one enqueue and wait per bucket, and the barrier's ops"),
            Target(f"{how}: first step, either over plain Keras", max(b, o) / p, 1.3, "x", False,
                   "horolite's ops in the graph, the first negotiation"),
        ]
    name = ("bucket_trace_first_resnet50" if args.model == "resnet50" else
            "bucket_trace_first" if args.tiny or variables == 300 else
            f"bucket_trace_first_{variables}")
    finish(None, args, name, {"model": args.model, "variables": variables, "np": 2,
                              "rounds": args.rounds, "results": results},
           ["how", "way", "first step per round (s)"], rows, targets)


if __name__ == "__main__":
    main()
