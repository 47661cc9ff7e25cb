"""The ring's paced sends (transport/ring.py, PACED) against all of the first step at once:
the same 64 MiB allreduce in alternating blocks of one job, so both see the same machine,
with an A/A pair (paced against paced) that shows this machine's noise. Nothing asserts a
speed; the ratios are printed. Across (pretend) hosts, over horolite's TCP connections:

    HOROLITE_TEST_HOST_IDENTITY=1+1 HOROLITE_CROSS_HOST_TRANSPORT=tcp \\
        mpirun -np 2 python bench/ring_send_ahead.py
"""
from __future__ import annotations

import argparse

import numpy as np
from mpi4py import MPI

import common

STATES = ("paced", "at once", "paced again")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--runs", type=int, default=24, help="timed runs per state")
    p.add_argument("--blocks", type=int, default=6)
    args = p.parse_args(argv)
    import horolite as hvd
    from horolite.transport import ring
    hvd.init()
    comm = MPI.COMM_WORLD
    buf = np.ones((args.mib << 20) // 4, np.float32)

    def run():
        hvd.allreduce(buf, name="send_ahead", op=hvd.Sum)
    per = max(1, -(-args.runs // args.blocks))
    times = {state: [] for state in STATES}
    for block in range(args.blocks):
        k = block % len(STATES)
        for state in STATES[k:] + STATES[:k]:  # (the order rotated every block)
            comm.Barrier()  # (no allreduce in flight while the setting changes)
            ring.PACED = state != "at once"
            times[state].extend(common._times(run, per, 1, comm))
    ring.PACED = True
    if hvd.rank() == 0:
        median = {state: float(np.median(t)) for state, t in times.items()}
        for state in STATES:
            print(f"{state:12s} {median[state] * 1e3:8.1f} ms  ({len(times[state])} runs)")
        print(f"paced / at once: {median['paced'] / median['at once']:.3f}   "
              f"A/A (paced again / paced): {median['paced again'] / median['paced']:.3f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
