"""Heartbeat cost: the small-tensor steps with the heartbeat on and off, in one job.

The heartbeat (horolite/failure/heartbeat.py) is ticked every background cycle and every
wait; it is switched off and on between interleaved blocks of the same job, so the
two are measured within a fraction of a second of each other. Also times tick()
itself: the usual call (no look due) and a call that looks at the posted receives.

    horolite-run -np 2 python bench/heartbeat_cost.py
"""
from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

import common
from common import interleaved_median_times

KiB = 1 << 10


def main(argv=None) -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400, help="timed runs of each variant")
    args = p.parse_args(argv)
    if args.tiny:
        args.steps = 8
    comm = MPI.COMM_WORLD
    common.wait_until_quiet(comm, args.quiet_below, args.quiet_timeout)

    import horolite as hvd
    from horolite.api import basics
    hvd.init()
    rt = basics.runtime()
    beat = rt.heartbeat
    tensors = [np.full(KiB, float(i), dtype=np.float32) for i in range(200)]
    names = [f"small.{i}" for i in range(200)]
    small = np.ones(KiB, dtype=np.float32)

    def switch(on):
        rt.heartbeat = rt.watch.heartbeat = beat if on else None

    def async_step():
        for h in [hvd.allreduce_async(t, op=hvd.Sum, name=n) for t, n in zip(tensors, names)]:
            hvd.synchronize(h)

    fns = {}
    for on in (True, False):
        label = "on" if on else "off"
        fns[f"4KiB_{label}_s"] = (lambda on=on: (switch(on), hvd.allreduce(small, name="lat")))
        fns[f"async_{label}_s"] = (lambda on=on: (switch(on), async_step()))
    res = interleaved_median_times(fns, args.steps, blocks=8, comm=comm)
    switch(True)
    hvd.allreduce(small, name="lat")

    # tick() alone, on this rank's heartbeat (the background thread is idle meanwhile).
    n = 20000 if not args.tiny else 200
    t0 = time.perf_counter()
    for _ in range(n):
        beat.tick()
    res["tick_idle_s"] = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for _ in range(n):
        beat._next_look = 0.0
        beat.tick()
    res["tick_look_s"] = (time.perf_counter() - t0) / n
    hvd.shutdown()

    us = 1e6
    columns = ["what", "heartbeat on", "heartbeat off", "on - off"]
    table = [["one 4 KiB allreduce (us)", f"{res['4KiB_on_s'] * us:.1f}",
              f"{res['4KiB_off_s'] * us:.1f}", f"{(res['4KiB_on_s'] - res['4KiB_off_s']) * us:+.1f}"],
             ["200 x 4 KiB async step (us)", f"{res['async_on_s'] * us:.1f}",
              f"{res['async_off_s'] * us:.1f}",
              f"{(res['async_on_s'] - res['async_off_s']) * us:+.1f}"],
             ["tick(), no look due (us per call)", f"{res['tick_idle_s'] * us:.3f}", "", ""],
             ["tick() with a look at the receives (us per call)", f"{res['tick_look_s'] * us:.2f}",
              "", ""]]
    common.finish(comm, args, "heartbeat_cost", {"steps": args.steps, "results": res},
                  columns, table, [], None)


if __name__ == "__main__":
    main()
