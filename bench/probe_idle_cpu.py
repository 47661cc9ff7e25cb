"""CPU an idle job burns: every rank initializes, does one allreduce, then sleeps;
prints each rank's CPU seconds (all threads) over the idle time (a probe beside the
benchmarks).

    horolite-run -np 2 python bench/probe_idle_cpu.py [--seconds 10]
"""
import argparse
import resource
import time

import numpy as np
from mpi4py import MPI


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=10.0)
    args = p.parse_args()
    import horolite as hvd
    hvd.init()
    hvd.allreduce(np.ones(1024, np.float32), name="warm")
    ru0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    time.sleep(args.seconds)
    ru1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    rows = MPI.COMM_WORLD.gather((hvd.rank(), cpu / (t1 - t0)), root=0)
    hvd.shutdown()
    if rows:
        for rank, frac in rows:
            print(f"rank {rank}: idle CPU {100 * frac:.2f}% of a core over {t1 - t0:.1f} s")


if __name__ == "__main__":
    main()
