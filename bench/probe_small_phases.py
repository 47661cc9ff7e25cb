"""Where one small allreduce spends its time: a per-phase breakdown (probes beside the
benchmark; nothing here is left in the package).

Wraps the runtime's steps with clock reads and reports, per phase, the median over
many synchronous 4 KiB allreduces (microseconds, rank 0's and rank 1's view):

    horolite-run -np 2 python bench/probe_small_phases.py [--iters 2000] [--bytes 4096]
    horolite-run -np 2 python bench/probe_small_phases.py --grouped 200   # 200 x 4 KiB grouped

Phases: submit (the caller builds and queues the request), wake (until the background
thread takes it), pre (the cycle's checks and cache lookup before the control message),
control (the control allreduce), post (decode and responses), exec-in (executor until
the data moves), data (the shared-memory allreduce), complete (until the handle is
set), return (until the caller holds the result). Probes add ~0.3 us each.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

clock = time.perf_counter
marks = {}


def mark(key):
    marks[key] = clock()


def wrap(obj, attr, before=None, after=None):
    orig = getattr(obj, attr)

    def wrapper(*a, **k):
        if before:
            mark(before)
        try:
            return orig(*a, **k)
        finally:
            if after:
                mark(after)
    setattr(obj, attr, wrapper)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--bytes", type=int, default=4096)
    p.add_argument("--grouped", type=int, default=0, help="tensors per grouped_allreduce")
    args = p.parse_args()
    import horolite as hvd
    from horolite.core.handle import Handle
    from horolite.runtime import registry
    hvd.init()
    rt = registry.current()
    wrap(rt.queue, "submit", "submit0", "submit1")
    wrap(rt.queue, "take_new", "take", None)
    wrap(rt.transport, "control_or", "ctl0", "ctl1")
    wrap(rt.executor, "run", "exec0", "exec1")
    sm = rt.transport.shared_memory
    if sm is not None:
        wrap(sm, "allreduce", "data0", "data1")
    orig_finish = Handle._finish

    def finish(self, value, exc):
        mark("done")
        return orig_finish(self, value, exc)
    Handle._finish = finish

    x = np.ones(args.bytes // 4, dtype=np.float32)
    xs = [np.full(args.bytes // 4, i, dtype=np.float32) for i in range(args.grouped)]
    if args.grouped:
        def call():
            hvd.grouped_allreduce(xs, op=hvd.Sum, name="probe")
    else:
        def call():
            hvd.allreduce(x, op=hvd.Sum, name="probe")
    rows = []
    comm = MPI.COMM_WORLD
    for i in range(args.iters):
        marks.clear()
        comm.Barrier()  # as the benchmark's median_time: every call starts together
        t0 = clock()
        call()
        t9 = clock()
        m = marks
        if not all(k in m for k in ("submit1", "take", "ctl0", "ctl1", "exec0", "done")):
            continue
        d0, d1 = m.get("data0", m["exec0"]), m.get("data1", m["exec0"])
        rows.append([m["submit1"] - t0, m["take"] - m["submit1"], m["ctl0"] - m["take"],
                     m["ctl1"] - m["ctl0"], m["exec0"] - m["ctl1"], d0 - m["exec0"],
                     d1 - d0, m["done"] - d1, t9 - m["done"], t9 - t0])
    hvd.shutdown()
    names = ["submit", "wake", "pre", "control", "post", "exec-in", "data", "complete",
             "return", "total"]
    med = np.median(np.array(rows[len(rows) // 10:]) * 1e6, axis=0)
    p90 = np.percentile(np.array(rows[len(rows) // 10:]) * 1e6, 90, axis=0)
    all_med = comm.gather(med, root=0)
    all_p90 = comm.gather(p90, root=0)
    if comm.Get_rank() == 0:
        what = f"{args.grouped} x {args.bytes} B grouped" if args.grouped else f"{args.bytes} B"
        print(f"{what} allreduce, {len(rows)} iterations, median (p90) us per phase")
        print("phase     " + "".join(f"  rank {r:<14d}" for r in range(len(all_med))))
        for i, n in enumerate(names):
            print(f"{n:<10}" + "".join(f"  {m[i]:7.1f} ({q[i]:7.1f})" for m, q in zip(all_med, all_p90)))


if __name__ == "__main__":
    main()
