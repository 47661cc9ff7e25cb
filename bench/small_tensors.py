"""Small tensors: a step of many 4 KiB gradients, and single-call latency.

A step is 200 float32 tensors of 4 KiB each (the shape of a model's many
small gradients), reduced
- with one grouped_allreduce,
- as 200 allreduce_async calls then a synchronize of each,
- as 200 separate MPI_Allreduce calls through mpi4py (the peer).
Plus the latency of one synchronous 4 KiB and one 1 MiB allreduce, against
MPI_Allreduce, and the latecomer measure: after a barrier rank r waits
r x 200 us before it submits, and the time counted is from the last rank's
submit to the last rank's result (the ranks of one host share the monotonic
clock), for one 4 KiB tensor and for the 200 x 4 KiB grouped, beside
MPI_Allreduce with the same skew. Once every rank has submitted nothing should
wait for a timer or a cycle, so this is the collective's own latency.
Default settings (no HOROLITE_* variable) unless you set them.

    horolite-run -np 2 python bench/small_tensors.py
"""
from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

import common
from common import Target, human_bytes, median_time

KiB, MiB = 1 << 10, 1 << 20
SKEW_SECONDS = 200e-6  # rank r submits r x this after the barrier


def latecomer_time(fn, iters: int, comm, skew: float = SKEW_SECONDS, warmup: int = 3) -> float:
    """Median over `iters` calls of fn of (last rank's result - last rank's submit), in
    seconds, rank r starting r x `skew` after a barrier. It sleeps rather than spins
    (ranks may outnumber cores); a late wake-up only moves the submit it records.
    Every rank of `comm` must be on this host."""
    rank = comm.Get_rank()
    times = np.empty(2)
    spans = []
    for i in range(warmup + iters):
        comm.Barrier()
        if rank:
            time.sleep(rank * skew)
        times[0] = time.monotonic()
        fn()
        times[1] = time.monotonic()
        every = np.empty((comm.Get_size(), 2))
        comm.Allgather(times, every)
        if i >= warmup:
            spans.append(every[:, 1].max() - every[:, 0].max())
    return float(np.median(spans))


def main(argv=None) -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--tensors", type=int, default=200, help="tensors per step")
    p.add_argument("--tensor-bytes", type=int, default=4 * KiB)
    p.add_argument("--steps", type=int, default=200, help="timed steps per variant")
    p.add_argument("--latency-iters", type=int, default=1000)
    p.add_argument("--stragglers-ab", action="store_true",
                   help="only compare the straggler record on and off (bench/straggler_ab.py)")
    args = p.parse_args(argv)
    if args.tiny:
        args.tensors, args.steps, args.latency_iters = 10, 5, 10

    comm = MPI.COMM_WORLD
    n = comm.Get_size()
    common.wait_until_quiet(comm, args.quiet_below, args.quiet_timeout)
    count = args.tensor_bytes // 4
    tensors = [np.full(count, float(i), dtype=np.float32) for i in range(args.tensors)]
    outs = [np.empty_like(t) for t in tensors]
    small, large = np.ones(KiB, dtype=np.float32), np.ones(MiB // 4, dtype=np.float32)
    small_out, large_out = np.empty_like(small), np.empty_like(large)

    def mpi_step():
        for t, o in zip(tensors, outs):
            comm.Allreduce(t, o, op=MPI.SUM)

    res = {}
    # The peer first, with no horolite thread running.
    res["mpi_step_s"] = median_time(mpi_step, args.steps, comm=comm)
    res["mpi_4KiB_s"] = median_time(lambda: comm.Allreduce(small, small_out, op=MPI.SUM),
                                    args.latency_iters, comm=comm)
    res["mpi_1MiB_s"] = median_time(lambda: comm.Allreduce(large, large_out, op=MPI.SUM),
                                    max(10, args.latency_iters // 10), comm=comm)
    late_iters = max(10, args.latency_iters // 2)
    res["mpi_late_4KiB_s"] = latecomer_time(lambda: comm.Allreduce(small, small_out, op=MPI.SUM),
                                            late_iters, comm)
    res["mpi_late_step_s"] = latecomer_time(mpi_step, max(10, args.steps // 2), comm)

    import horolite as hvd
    hvd.init()
    names = [f"small.{i}" for i in range(args.tensors)]

    def async_step():
        handles = [hvd.allreduce_async(t, op=hvd.Sum, name=nm) for t, nm in zip(tensors, names)]
        for h in handles:
            hvd.synchronize(h)

    if args.stragglers_ab:
        import straggler_ab
        step_label = f"{args.tensors} x {human_bytes(args.tensor_bytes)}"
        latency = straggler_ab.compare(
            {"one 4 KiB allreduce": lambda: hvd.allreduce(small, op=hvd.Sum, name="lat4k")},
            args.latency_iters, 10, comm)
        steps = straggler_ab.compare({
            f"{step_label} grouped": lambda: hvd.grouped_allreduce(tensors, op=hvd.Sum,
                                                                   name="group"),
            f"{step_label} async + synchronize": async_step}, args.steps, 10, comm)
        hvd.shutdown()
        straggler_ab.print_table("small collectives: latency", latency, comm)
        straggler_ab.print_table("small collectives: steps", steps, comm)
        return

    res["grouped_step_s"] = median_time(
        lambda: hvd.grouped_allreduce(tensors, op=hvd.Sum, name="group"), args.steps, comm=comm)
    res["async_step_s"] = median_time(async_step, args.steps, comm=comm)
    res["horolite_4KiB_s"] = median_time(lambda: hvd.allreduce(small, op=hvd.Sum, name="lat4k"),
                                         args.latency_iters, comm=comm)
    res["horolite_1MiB_s"] = median_time(lambda: hvd.allreduce(large, op=hvd.Sum, name="lat1m"),
                                         max(10, args.latency_iters // 10), comm=comm)
    res["horolite_late_4KiB_s"] = latecomer_time(
        lambda: hvd.allreduce(small, op=hvd.Sum, name="late4k"), late_iters, comm)
    res["horolite_late_grouped_s"] = latecomer_time(
        lambda: hvd.grouped_allreduce(tensors, op=hvd.Sum, name="lategroup"),
        max(10, args.steps // 2), comm)
    hvd.shutdown()

    ms = 1e3
    step_label = f"{args.tensors} x {human_bytes(args.tensor_bytes)} step"
    columns = ["what", "horolite ms", "MPI_Allreduce ms", "horolite / MPI"]
    table = [
        [f"{step_label}, grouped", f"{res['grouped_step_s'] * ms:.3f}",
         f"{res['mpi_step_s'] * ms:.3f} ({args.tensors} calls)",
         f"{res['grouped_step_s'] / res['mpi_step_s']:.2f}"],
        [f"{step_label}, {args.tensors} async + synchronize", f"{res['async_step_s'] * ms:.3f}",
         f"{res['mpi_step_s'] * ms:.3f} ({args.tensors} calls)",
         f"{res['async_step_s'] / res['mpi_step_s']:.2f}"],
        ["one 4 KiB allreduce", f"{res['horolite_4KiB_s'] * ms:.3f}",
         f"{res['mpi_4KiB_s'] * ms:.3f}", f"{res['horolite_4KiB_s'] / res['mpi_4KiB_s']:.2f}"],
        ["one 1 MiB allreduce", f"{res['horolite_1MiB_s'] * ms:.3f}",
         f"{res['mpi_1MiB_s'] * ms:.3f}", f"{res['horolite_1MiB_s'] / res['mpi_1MiB_s']:.2f}"],
        ["latecomer: one 4 KiB allreduce", f"{res['horolite_late_4KiB_s'] * ms:.3f}",
         f"{res['mpi_late_4KiB_s'] * ms:.3f}",
         f"{res['horolite_late_4KiB_s'] / res['mpi_late_4KiB_s']:.2f}"],
        [f"latecomer: {step_label}, grouped", f"{res['horolite_late_grouped_s'] * ms:.3f}",
         f"{res['mpi_late_step_s'] * ms:.3f} ({args.tensors} calls)",
         f"{res['horolite_late_grouped_s'] / res['mpi_late_step_s']:.2f}"],
    ]
    # Issue 28's targets at np 2 on one host: 4 KiB in <= 50 us, 200 x 4 KiB grouped <= 0.3 ms.
    targets = [Target("one synchronous 4 KiB allreduce", res["horolite_4KiB_s"] * ms, 0.05, "ms",
                      False, LIMITS["latency"])]
    # Issue 40: the latecomer's 4 KiB within 2x MPI_Allreduce's with the same skew, here;
    # on a 16-core machine <= 50 us at np 2-8 and <= 100 us at np 16 (printed wherever it runs).
    targets.append(Target("latecomer 4 KiB, ratio to MPI_Allreduce's latecomer",
                          res["horolite_late_4KiB_s"] / res["mpi_late_4KiB_s"], 2.0, "x",
                          False, LIMITS["latecomer"]))
    targets.append(Target(f"latecomer 4 KiB at np {n} (16-core machine: <= "
                          f"{'50' if n <= 8 else '100'} us)", res["horolite_late_4KiB_s"] * 1e6,
                          50.0 if n <= 8 else 100.0, "us", False, LIMITS["latecomer"]))
    if args.tensors == 200 and args.tensor_bytes == 4 * KiB:
        targets += [
            Target("200 x 4 KiB grouped, per step", res["grouped_step_s"] * ms, 0.3, "ms", False,
                   LIMITS["grouped"]),
            Target("200 x 4 KiB as 200 async calls, per step", res["async_step_s"] * ms, 3.0, "ms",
                   False, LIMITS["async"]),
            Target("latecomer 200 x 4 KiB grouped", res["horolite_late_grouped_s"] * ms, 0.3,
                   "ms", False, LIMITS["grouped"]),
        ]
        if n >= 16:
            targets.append(Target("200 x 4 KiB grouped at np 16 (16-core machine)",
                                  res["grouped_step_s"] * ms, 0.5, "ms", False, LIMITS["grouped"]))

    def plot(ax):
        labels = ["grouped step", "async step", "4 KiB", "1 MiB"]
        h = [res[k] * ms for k in ("grouped_step_s", "async_step_s", "horolite_4KiB_s", "horolite_1MiB_s")]
        m = [res[k] * ms for k in ("mpi_step_s", "mpi_step_s", "mpi_4KiB_s", "mpi_1MiB_s")]
        x = np.arange(len(labels))
        ax.bar(x - 0.2, h, 0.4, label="horolite")
        ax.bar(x + 0.2, m, 0.4, label="MPI_Allreduce (mpi4py)")
        ax.set_xticks(x, labels)
        ax.set_yscale("log")
        ax.set_ylabel("median time (ms)")
        ax.legend(fontsize=8)

    common.finish(comm, args, "small_tensors",
                  {"tensors": args.tensors, "tensor_bytes": args.tensor_bytes,
                   "steps": args.steps, "latency_iters": args.latency_iters, "results": res},
                  columns, table, targets, plot)


# What the profile shows limits each target when it is missed (docs/benchmarks.md has the detail).
LIMITS = {
    "latency": "Python on the caller's thread, which runs the cycle itself (no hand-off): "
               "~10 us to build and queue the request, ~25 us of cycle (failure check, cache "
               "lookup, posting the bytes, the control vector, the round on the board), ~10 us "
               "to reduce the carried bytes and complete the handle, against one C call "
               "(bench/probe_small_phases.py)",
    "grouped": "per-member work and the exchange: the caller packs 200 arrays (~0.11 ms), "
               "800 KiB through shared memory (~0.1 ms), the result split into 200 views "
               "(~0.035 ms), and one cycle of Python",
    "latecomer": "Python, not waiting: the last rank's cycle (~25-35 us on its caller's thread) "
                 "before its entry completes the round, then each rank reduces the carried "
                 "bytes and returns (~10 us); MPI_Allreduce's latecomer is one C call that "
                 "spins. On 2 shared cores the earlier rank's wake from the round's futex also "
                 "waits for a core",
    "async": "per-tensor Python on both threads: ~4 us to submit on the caller, ~5 us in the "
             "background thread (cache lookup, packing, views, completion), with 2 ranks x 2 "
             "threads sharing 2 cores",
}

if __name__ == "__main__":
    main()
