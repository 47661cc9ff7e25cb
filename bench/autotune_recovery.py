"""Autotune: from a poor start (50 ms cycle time) back to near the best hand-set throughput.

A steady gradient-exchange workload (a step = N tensors submitted
asynchronously, then awaited) runs with HOROLITE_AUTOTUNE=1 starting from
cycle_time_ms=50 until the tuner settles, and its throughput then is
reported. The target compares the setting it chose with the hand-set cycle
times: in each of --rounds rounds every hand-set cycle time and the tuner's
setting (autotune off, its fusion threshold and cycle time set by hand) run
back to back, so they see the machine within seconds of each other; the
target is the median over rounds of the tuner's setting over the best
hand-set one of the same round. (This VM's speed moves by 20% within a
minute: one pass of each, minutes apart, compares the machine's moods.)

    horolite-run -np 2 python bench/autotune_recovery.py
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import horolite as hvd  # noqa: E402
from horolite.api import basics  # noqa: E402


def run_steps(tensors, seconds: float, comm) -> float:
    """Bytes reduced per second over about `seconds` of back-to-back steps."""
    done, start = 0, time.perf_counter()
    while True:
        handles = [hvd.allreduce_async(t, name=f"grad.{i}") for i, t in enumerate(tensors)]
        for h in handles:
            h.result()
        done += 1
        # Ranks must run the same number of steps: rank 0's clock decides.
        if comm.bcast(time.perf_counter() - start >= seconds if comm.rank == 0 else None):
            break
    elapsed = time.perf_counter() - start
    return done * sum(t.nbytes for t in tensors) / elapsed


def configure(**env) -> None:
    hvd.shutdown()
    # Every variable any measurement sets: none may carry over into the next one.
    for key in ("HOROLITE_CYCLE_TIME", "HOROLITE_FUSION_THRESHOLD", "HOROLITE_AUTOTUNE",
                "HOROLITE_AUTOTUNE_START", "HOROLITE_AUTOTUNE_LOG"):
        os.environ.pop(key, None)
    os.environ.update({k: str(v) for k, v in env.items()})
    hvd.init()


def main():
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--tensors", type=int, default=40)
    p.add_argument("--tensor-kib", type=int, default=64)
    p.add_argument("--seconds", type=float, default=2.0, help="per measurement")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every setting back to back")
    args = p.parse_args()
    if args.tiny:
        args.tensors, args.tensor_kib, args.seconds, args.rounds = 8, 4, 0.5, 1
    hvd.init()
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    tensors = [np.ones(args.tensor_kib * 256, np.float32) for _ in range(args.tensors)]

    log = os.path.join(os.path.dirname(os.path.abspath(args.out or common.RESULTS + "/x")),
                       "autotune_recovery_log.csv")
    configure(HOROLITE_AUTOTUNE=1, HOROLITE_AUTOTUNE_START="cycle_time_ms=50",
              HOROLITE_AUTOTUNE_LOG=log if comm.rank == 0 else "")
    tuner = basics.runtime().autotuner
    start = time.perf_counter()
    first = None
    limit = 5.0 if args.tiny else 120.0
    while True:
        rate = run_steps(tensors, 0.5, comm)
        first = rate if first is None else first
        settled = comm.allreduce(tuner.done if tuner is not None else True, op=MPI.LAND)
        if settled or time.perf_counter() - start > limit:
            break
    settle_s = time.perf_counter() - start
    live = comm.allreduce(run_steps(tensors, args.seconds, comm), op=MPI.MIN)
    setting = basics.runtime()._setting

    def measure(**env) -> float:
        configure(**env)
        run_steps(tensors, min(1.0, args.seconds / 4), comm)  # warm the response cache
        return comm.allreduce(run_steps(tensors, args.seconds, comm), op=MPI.MIN)

    cycles = (1, 5, 50)
    rounds = []  # per round: {cycle: rate}, and "tuned"
    for _ in range(args.rounds):
        rates = {c: measure(HOROLITE_CYCLE_TIME=c) for c in cycles}
        rates["tuned"] = measure(HOROLITE_CYCLE_TIME=setting[1],
                                 HOROLITE_FUSION_THRESHOLD=setting[0])
        rounds.append(rates)
    ratios = [r["tuned"] / max(r[c] for c in cycles) for r in rounds]
    ratio = float(np.median(ratios))
    med = {k: float(np.median([r[k] for r in rounds])) for k in (*cycles, "tuned")}

    rows = [[f"hand-set cycle {c} ms (median of {args.rounds} rounds)", f"{med[c] / 1e6:.1f}", ""]
            for c in cycles]
    rows.append(["autotune, first 0.5 s (start: 50 ms)", f"{first / 1e6:.1f}", ""])
    rows.append([f"autotune, settled after {settle_s:.0f} s", f"{live / 1e6:.1f}",
                 f"fusion {setting[0]} B, cycle {setting[1]:g} ms"])
    rows.append([f"the tuner's setting, by hand (median of {args.rounds} rounds)",
                 f"{med['tuned'] / 1e6:.1f}", f"fusion {setting[0]} B, cycle {setting[1]:g} ms"])
    by_round = ", ".join(f"{x:.2f}" for x in ratios)
    targets = [common.Target("autotuned setting / best hand-set throughput (median of rounds)",
                             ratio, 0.8, "x", True,
                             f"the tuner's choice under this run's noise (by round: {by_round}); "
                             "see the log")]
    if args.tiny:
        targets = []
    common.finish(comm, args, "autotune_recovery",
                  {"hand_set_bytes_per_s": {str(c): med[c] for c in cycles},
                   "rounds": [{str(k): v for k, v in r.items()} for r in rounds],
                   "tuned_vs_best_by_round": ratios, "tuned_vs_best": ratio,
                   "autotune_first_bytes_per_s": first, "autotune_settled_bytes_per_s": live,
                   "settle_seconds": settle_s, "setting": list(setting), "log": log},
                  ["configuration", "MB/s reduced", "setting"], rows, targets)
    hvd.shutdown()


if __name__ == "__main__":
    main()
