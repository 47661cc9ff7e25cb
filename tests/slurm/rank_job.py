"""What each rank runs in the Slurm tests: horolite collectives on rank-dependent inputs.

Writes ``<outdir>/<rank>.json`` with what the runtime saw (rank, size, the
allreduce of ``arange(5) * (rank + 1)``, the allgather of ranks), the host, the
pid and the Slurm variables (SLURMD_NODENAME: the Slurm node); then fails or sleeps as asked.
"""
import argparse
import json
import os
import socket
import time

import numpy as np

import horolite as hvd
from horolite.failure.shm_files import mapped_shm_files


def main():
    p = argparse.ArgumentParser()
    p.add_argument("outdir")
    p.add_argument("--fail-rank", type=int, default=None)
    p.add_argument("--fail-code", type=int, default=3)
    p.add_argument("--sleep", type=float, default=0.0)
    args = p.parse_args()
    hvd.init()
    rank = hvd.rank()
    total = hvd.allreduce(np.arange(5, dtype=np.float64) * (rank + 1), op=hvd.Sum, name="sum")
    ranks = hvd.allgather(np.array([rank], dtype=np.int32), name="ranks")
    mark = {"rank": rank, "size": hvd.size(), "local_size": hvd.local_size(),
            "sum": total.tolist(), "ranks": ranks.tolist(), "pid": os.getpid(),
            "host": socket.gethostname(),
            "slurm": {k: v for k, v in os.environ.items() if k.startswith("SLURM")},
            "shm": sorted(mapped_shm_files(os.getpid()))}  # what must not outlive a failure
    tmp = os.path.join(args.outdir, f".{rank}.tmp")
    with open(tmp, "w") as f:
        json.dump(mark, f)
    os.replace(tmp, os.path.join(args.outdir, f"{rank}.json"))
    if args.fail_rank == rank:  # dies as a crash would: no shutdown, no MPI_Finalize
        time.sleep(0.3)
        os._exit(args.fail_code)
    deadline = time.time() + args.sleep
    while time.time() < deadline:
        time.sleep(0.1)
    hvd.shutdown()


if __name__ == "__main__":
    main()
