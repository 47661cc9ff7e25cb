"""Adasum against Average on the same step: what choosing op=Adasum costs in time.

A step's gradients (float32: many small tensors and a few large ones, like a model's
layers) are reduced with grouped_allreduce, op=Average and op=Adasum, in interleaved
rounds (bench/common.py); then one large tensor alone. Printed: each variant's median
time of the slowest rank and the ratio Adasum / Average (above 1: Adasum is slower).
Average goes through shared memory on one host, Adasum through MPI point-to-point
(transport/adasum.py): the ratio includes that difference. Nothing here is a target.

    horolite-run -np 2 python bench/adasum_step.py
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

import common
from common import human_bytes, interleaved_median_times

MiB = 1 << 20


def step_tensors(scale: float):
    """The step's gradients: 64 small (16 KiB), 12 medium (256 KiB), 4 large (4 MiB)."""
    sizes = [16 << 10] * 64 + [256 << 10] * 12 + [4 * MiB] * 4
    rng = np.random.RandomState(1 + MPI.COMM_WORLD.Get_rank())
    return [rng.normal(size=max(1, int(s * scale) // 4)).astype(np.float32) for s in sizes]


def main(argv=None) -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=40, help="timed runs of each variant")
    p.add_argument("--large-bytes", type=int, default=64 * MiB)
    args = p.parse_args(argv)
    scale = 1.0
    if args.tiny:
        args.iters, args.large_bytes, scale = 4, MiB, 1 / 64

    comm = MPI.COMM_WORLD
    common.wait_until_quiet(comm, args.quiet_below, args.quiet_timeout)
    import horolite as hvd
    hvd.init()
    tensors = step_tensors(scale)
    large = np.random.RandomState(9 + comm.Get_rank()).normal(
        size=args.large_bytes // 4).astype(np.float32)
    step_bytes = sum(t.nbytes for t in tensors)

    times = interleaved_median_times({
        "step_average_s": lambda: hvd.grouped_allreduce(tensors, op=hvd.Average, name="s.avg"),
        "step_adasum_s": lambda: hvd.grouped_allreduce(tensors, op=hvd.Adasum, name="s.ada"),
        "large_average_s": lambda: hvd.allreduce(large, op=hvd.Average, name="l.avg"),
        "large_adasum_s": lambda: hvd.allreduce(large, op=hvd.Adasum, name="l.ada"),
    }, args.iters, comm=comm)
    hvd.shutdown()

    ms = 1e3
    rows = [(f"step: {len(tensors)} tensors, {human_bytes(step_bytes)}", "step"),
            (f"one tensor of {human_bytes(large.nbytes)}", "large")]
    columns = ["what", "Average ms", "Adasum ms", "Adasum / Average"]
    table, ratios = [], {}
    for label, key in rows:
        avg, ada = times[f"{key}_average_s"], times[f"{key}_adasum_s"]
        ratios[f"{key}_adasum_over_average"] = ada / avg
        table.append([label, f"{avg * ms:.2f}", f"{ada * ms:.2f}", f"{ada / avg:.2f}"])

    def plot(ax):
        x = np.arange(len(rows))
        ax.bar(x - 0.2, [times[f"{k}_average_s"] * ms for _, k in rows], 0.4, label="Average")
        ax.bar(x + 0.2, [times[f"{k}_adasum_s"] * ms for _, k in rows], 0.4, label="Adasum")
        ax.set_xticks(x, [label for label, _ in rows])
        ax.set_ylabel("median time (ms)")
        ax.legend(fontsize=8)

    common.finish(comm, args, "adasum_step",
                  {"iters": args.iters, "step_bytes": step_bytes, "large_bytes": large.nbytes,
                   "results": dict(times, **ratios)}, columns, table, [], plot)


if __name__ == "__main__":
    main()
