"""Where a rank's CPU goes during a step across hosts, thread by thread.

Run as root: builds two simulated hosts (tests/multihost/bed.py), caps each link at
--rate, and runs ``horolite-run -H hl-a:1,hl-b:1`` once per cross-host transport
named in --transports (HOROLITE_CROSS_HOST_TRANSPORT), alternating them --rounds
times in this one run, so their numbers come from the same minutes of the machine.
Each rank runs one TensorFlow thread. For each kind of step (plain: no exchange;
exchange: one grouped allreduce shaped like the gradients; tape:
DistributedGradientTape with its default buckets) it reads every thread's CPU time
before and after the steps (/proc/self/task/<tid>/schedstat, nanoseconds, matched to
Python threads by threading.get_native_id()) and its voluntary context switches (a
thread that sleeps in a polling loop switches thousands of times a second; one
blocked in the kernel, once per message or so), and prints per step: wall time,
CPU per thread group, and wake-ups.

    python bench/thread_cpu_step.py                          # mpi vs tcp, 40x256:512
    python bench/thread_cpu_step.py --transports mpi --steps 10
    python bench/thread_cpu_step.py --transports tcp,gloo --hosts hl-a:2,hl-b:2

``gloo`` is a job started without MPI (``horolite-run --gloo``): horolite's TCP
connections across hosts, its own world for everything else.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _thread_groups() -> dict:
    """{native id: group name} of this process's Python threads."""
    groups = {}
    for t in threading.enumerate():
        name = t.name
        for prefix, group in (("horolite-background", "background"),
                              ("horolite-exchange", "exchange lane"),
                              ("horolite-tcp", "tcp link"), ("MainThread", "main")):
            if name.startswith(prefix):
                break
        else:
            group = "other horolite" if name.startswith("horolite") else "other python"
        groups[t.native_id] = group
    return groups


TICK_NS = 1e9 / os.sysconf("SC_CLK_TCK")


def task_times() -> dict:
    """{tid: (cpu ns, voluntary switches, user-space ns)} of every thread of this process
    (the user-space share in clock ticks: enough over many steps to say whether a thread's
    time is Python's and NumPy's or the kernel's)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                cpu = int(f.read().split()[0])
            with open(f"/proc/self/task/{tid}/stat") as f:
                user = int(f.read().rsplit(")", 1)[1].split()[11]) * TICK_NS
            with open(f"/proc/self/task/{tid}/status") as f:
                switches = next(int(line.split()[1]) for line in f
                                if line.startswith("voluntary_ctxt_switches"))
        except (OSError, StopIteration, ValueError):
            continue
        out[int(tid)] = (cpu, switches, user)
    return out


def per_group(before: dict, after: dict, steps: int) -> dict:
    """{group: [cpu ms per step, wake-ups per step, user-space cpu ms per step]}; threads
    not from Python are TensorFlow's (or MPI's own)."""
    groups = _thread_groups()
    rows = {}
    for tid, (cpu, sw, user) in after.items():
        cpu0, sw0, user0 = before.get(tid, (0, 0, 0))
        row = rows.setdefault(groups.get(tid, "native (TensorFlow, MPI)"), [0.0, 0.0, 0.0])
        row[0] += (cpu - cpu0) / 1e6 / steps
        row[1] += (sw - sw0) / steps
        row[2] += (user - user0) / 1e6 / steps
    return rows


# ---- rank side ----

def worker(args) -> None:
    import numpy as np
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras
    import horolite.tensorflow as hvd
    from horolite.core.mpi_library import MPI  # the job world's (mpi4py's under mpirun)
    from horolite.runtime import registry
    from tf_steps import step_functions

    hvd.init()
    comm = MPI.COMM_WORLD
    layers, width = (int(v) for v in args.model.split(":")[0].split("x"))
    batch = int(args.model.split(":")[1])
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((width,))] + [keras.layers.Dense(width, activation="relu")
                                                         for _ in range(layers)] +
                             [keras.layers.Dense(10)])
    rng = np.random.default_rng(hvd.rank())
    x = tf.constant(rng.standard_normal((batch, width)).astype(np.float32))
    y = tf.constant(rng.integers(0, 10, batch))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = keras.optimizers.SGD(1e-4)

    step_fn, exchange = step_functions(model, x, y, loss_fn, opt, hvd, "thread_cpu.exchange")

    fns = {"plain": step_fn(None), "exchange": exchange,
           "tape": step_fn(lambda t: hvd.DistributedGradientTape(t))}
    rows = {}
    for name, fn in fns.items():
        for _ in range(args.warmup):
            fn().numpy()
        comm.Barrier()
        before, ru0, t0 = task_times(), resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        for _ in range(args.steps):
            fn().numpy()
        wall = (time.perf_counter() - t0) / args.steps
        after, ru1 = task_times(), resource.getrusage(resource.RUSAGE_SELF)
        cpu = (ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime) / args.steps
        comm.Barrier()
        rows[name] = {"wall_ms": 1e3 * wall, "cpu_ms": 1e3 * cpu,
                      "threads": per_group(before, after, args.steps)}
    rt = registry.current()
    link = getattr(rt.transport, "cross_host", None)
    everyone = comm.gather({"rank": hvd.rank(), "rows": rows,
                            "transport": getattr(link, "kind", "mpi")}, root=0)
    if comm.Get_rank() == 0:
        print("RESULT " + json.dumps(everyone), flush=True)
    hvd.shutdown()


# ---- driver ----

def _user_share(v) -> str:
    """Only for groups with 0.5 ms a step or more: below, clock ticks say nothing."""
    return f", {100 * v[2] / v[0]:.0f}% user" if v[0] >= 0.5 else ""


def report(doc: dict) -> str:
    lines = ["| transport | step | rank | wall ms | CPU ms (getrusage) | CPU / wall | "
             "per thread: CPU ms (wake-ups, share in user space) per step |",
             "|---|---|---|---|---|---|---|"]
    for run in doc["runs"]:
        for rank_doc in run["ranks"]:
            for step, row in rank_doc["rows"].items():
                threads = "; ".join(f"{g} {v[0]:.1f} ({v[1]:.0f}{_user_share(v)})" for g, v in
                                    sorted(row["threads"].items(), key=lambda kv: -kv[1][0])
                                    if v[0] >= 0.05 or v[1] >= 1)
                lines.append(f"| {run['asked']} | {step} | {rank_doc['rank']} | "
                             f"{row['wall_ms']:.0f} | {row['cpu_ms']:.0f} | "
                             f"{row['cpu_ms'] / row['wall_ms']:.2f} | {threads} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default="40x256:512", help="layers x width : batch")
    p.add_argument("--transports", default="mpi,tcp",
                   help="HOROLITE_CROSS_HOST_TRANSPORT values, one job each, alternating; "
                        "gloo: a job started with horolite-run --gloo")
    p.add_argument("--hosts", default="hl-a:1,hl-b:1", help="horolite-run -H (two hosts)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--rate", default="1gbit", help="tc tbf rate of every link ('' for none)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    sys.path.insert(0, HERE)
    from common import simulated_hosts
    run = os.path.join(os.path.dirname(sys.executable), "horolite-run")
    work = [sys.executable, os.path.abspath(__file__), "--worker", "--model", args.model,
            "--steps", str(args.steps), "--warmup", str(args.warmup)]
    doc = {"benchmark": "thread_cpu_step", "model": args.model,
           "where": f"simulated hosts {args.hosts}, links at {args.rate or 'veth, uncapped'}",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "runs": []}
    with simulated_hosts(2, args.rate, "thread_cpu_step") as bed:
        for _ in range(args.rounds):
            for transport in args.transports.split(","):
                gloo = ["--gloo"] if transport == "gloo" else []
                proc = bed.run([run] + gloo + ["-H", args.hosts] + work, timeout=1800,
                               env={"HOROLITE_CROSS_HOST_TRANSPORT":
                                    "tcp" if transport == "gloo" else transport})
                found = [line.split("RESULT ", 1)[1] for line in proc.stdout.splitlines()
                         if "RESULT " in line]
                if not found:
                    print(f"{transport}: run failed (exit {proc.returncode}):\n"
                          f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}", file=sys.stderr)
                    return 1
                doc["runs"].append({"asked": transport, "ranks": json.loads(found[0])})
    doc["load_average"] = os.getloadavg()
    md = report(doc)
    out = args.out or os.path.join(HERE, "results", "thread_cpu_step.json")
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
