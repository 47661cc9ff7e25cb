"""Backup workers: a step's allreduce with stragglers, all ranks against a quorum.

A step is --compute-ms of work (a sleep: the benchmark measures waiting, not
the cores) then a grouped allreduce of --grad-bytes of float32 gradients. At
every step one rank, drawn at random (the same draw on every rank), sleeps
--straggler-ms more. Three variants, run in alternating blocks:
- all: grouped_allreduce over every rank (what DistributedOptimizer does),
- quorum: grouped_allreduce(..., quorum=size-1) (SyncReplicasOptimizer with one backup),
- no straggler: grouped_allreduce over every rank without the extra sleep (the bound).
A block ends with a barrier, so its time is the slowest rank's. Printed: time per
step of each and the ratio all / quorum (higher: the quorum saves more).

    horolite-run -np 4 python bench/quorum_stragglers.py
"""
from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

import common

import horolite as hvd


def main(argv=None) -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60, help="steps per block")
    p.add_argument("--blocks", type=int, default=3, help="blocks per variant, interleaved")
    p.add_argument("--compute-ms", type=float, default=10.0)
    p.add_argument("--straggler-ms", type=float, default=50.0)
    p.add_argument("--grad-bytes", type=int, default=1 << 20)
    args = p.parse_args(argv)
    if args.tiny:
        args.steps, args.blocks, args.compute_ms, args.straggler_ms = 10, 1, 1.0, 5.0
    comm = MPI.COMM_WORLD
    common.wait_until_quiet(comm, args.quiet_below, args.quiet_timeout)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    grads = [np.full(args.grad_bytes // 8, rank, np.float32), np.ones(args.grad_bytes // 8, np.float32)]
    draws = np.random.RandomState(0)

    def block(name, quorum, straggle):
        hvd.barrier()
        start = time.perf_counter()
        for _ in range(args.steps):
            late = straggle and size > 1 and draws.randint(size) == rank
            time.sleep((args.compute_ms + (args.straggler_ms if late else 0.0)) / 1000.0)
            hvd.grouped_allreduce(grads, name=f"bench.{name}", quorum=quorum)
        hvd.barrier()
        return (time.perf_counter() - start) / args.steps

    variants = {"all": (None, True), "quorum": (max(size - 1, 1), True), "no straggler": (None, False)}
    times = {name: [] for name in variants}
    for _ in range(args.blocks):
        for name, (quorum, straggle) in variants.items():
            times[name].append(block(name.replace(" ", "_"), quorum, straggle))
    med = {name: float(np.median(t)) for name, t in times.items()}
    ms = 1000.0
    ratio = med["all"] / med["quorum"]
    columns = ["variant", "ms per step (median of blocks)", "vs quorum"]
    table = [[name, f"{med[name] * ms:.2f}", f"{med[name] / med['quorum']:.2f}"] for name in variants]
    hvd.shutdown()
    common.finish(comm, args, "quorum_stragglers",
                  {"steps": args.steps, "blocks": args.blocks, "compute_ms": args.compute_ms,
                   "straggler_ms": args.straggler_ms, "grad_bytes": args.grad_bytes,
                   "seconds_per_step": times, "median_seconds_per_step": med,
                   "all_vs_quorum": ratio},
                  columns, table, [])


if __name__ == "__main__":
    main()
