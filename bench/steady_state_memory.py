"""Steady-state memory: resident memory growth over 10,000 allreduces of mixed sizes.

Each step submits one allreduce_async per size in a fixed mix (1 KiB to
4 MiB, float32, the same names every step, so the response cache and fusion
are in their steady state) and synchronizes them; results are dropped, as a
training loop drops last step's gradients. RSS is read from /proc after a
warm-up (buffers grown to their final size) and sampled until the end; the
target is growth below 5 MB on every rank.

    horolite-run -np 2 python bench/steady_state_memory.py
"""
from __future__ import annotations


import numpy as np
from mpi4py import MPI

import common
from common import Target, human_bytes

MIX = [1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 4 << 10, 64 << 10, 1 << 10]


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def main(argv=None) -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=10_000, help="allreduces after the warm-up")
    p.add_argument("--warmup-calls", type=int, default=500)
    p.add_argument("--samples", type=int, default=50, help="RSS samples over the run")
    p.add_argument("--tracemalloc", action="store_true",
                   help="also print the Python allocation sites that grew most (slow)")
    args = p.parse_args(argv)
    if args.tiny:
        args.calls, args.warmup_calls, args.samples = 200, 50, 5

    comm = MPI.COMM_WORLD
    common.wait_until_quiet(comm, args.quiet_below, args.quiet_timeout)
    import horolite as hvd
    hvd.init()
    inputs = [np.full(s // 4, 1.0, dtype=np.float32) for s in MIX]
    names = [f"mem.{i}" for i in range(len(MIX))]

    def step():
        handles = [hvd.allreduce_async(a, op=hvd.Sum, name=nm) for a, nm in zip(inputs, names)]
        for h in handles:
            hvd.synchronize(h)

    for _ in range(-(-args.warmup_calls // len(MIX))):
        step()
    if args.tracemalloc:
        import tracemalloc
        tracemalloc.start(8)
        snap0 = tracemalloc.take_snapshot()
    steps = -(-args.calls // len(MIX))
    every = max(1, steps // args.samples)
    start_rss = rss_bytes()
    samples = [(0, start_rss)]
    for i in range(1, steps + 1):
        step()
        if i % every == 0 or i == steps:
            samples.append((i * len(MIX), rss_bytes()))
    end_rss = rss_bytes()
    if args.tracemalloc:
        top = tracemalloc.take_snapshot().compare_to(snap0, "traceback")[:5]
        for stat in top:
            print(f"rank {comm.Get_rank()}: {stat}\n  " + "\n  ".join(stat.traceback.format()))
    hvd.shutdown()

    per_rank = comm.allgather({"start_rss": start_rss, "end_rss": end_rss,
                               "growth": end_rss - start_rss, "samples": samples})
    worst = max(r["growth"] for r in per_rank)
    columns = ["rank", "RSS after warm-up MB", "RSS at end MB", "growth MB"]
    table = [[str(i), f"{r['start_rss'] / 1e6:.1f}", f"{r['end_rss'] / 1e6:.1f}",
              f"{r['growth'] / 1e6:+.2f}"] for i, r in enumerate(per_rank)]
    calls = steps * len(MIX)
    targets = [Target(f"RSS growth over {calls} allreduces (worst rank)", worst / 1e6, 5.0, "MB",
                      False, "see docs/benchmarks.md")]

    def plot(ax):
        for i, r in enumerate(per_rank):
            xs, ys = zip(*r["samples"])
            ax.plot(xs, [(y - r["start_rss"]) / 1e6 for y in ys], label=f"rank {i}")
        ax.axhline(5.0, color="r", ls="--", alpha=0.5, label="target: 5 MB")
        ax.set_xlabel("allreduces after warm-up")
        ax.set_ylabel("RSS growth (MB)")
        ax.legend(fontsize=8)

    common.finish(comm, args, "steady_state_memory",
                  {"mix_bytes": MIX, "mix": [human_bytes(s) for s in MIX], "calls": calls,
                   "warmup_calls": args.warmup_calls, "per_rank": per_rank,
                   "worst_growth_bytes": worst},
                  columns, table, targets, plot)


if __name__ == "__main__":
    main()
