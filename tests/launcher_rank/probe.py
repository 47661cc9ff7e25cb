"""What one rank runs in the launcher's end-to-end tests (tests/launcher/).

It starts horolite, leaves a mark file ``<outdir>/<rank>.json`` saying which
rank()/size() the runtime saw and which HOROLITE_* variables it got, then
optionally fails in the way the test asks. HOROLITE_PROBE_API=mpi4py uses
mpi4py instead of horolite (to test the launcher alone).
"""
import argparse
import json
import os
import signal
import socket
import sys
import time


def main():
    p = argparse.ArgumentParser()
    p.add_argument("outdir")
    p.add_argument("--fail-rank", type=int, default=None)
    p.add_argument("--fail-how", choices=("exit", "hard-exit", "raise", "kill"), default="exit")
    p.add_argument("--fail-code", type=int, default=3)
    p.add_argument("--sleep", type=float, default=0.0, help="then sleep this long (to be stopped)")
    p.add_argument("--train", type=float, default=0.0,
                   help="then allreduce in a loop this many seconds, as training would")
    p.add_argument("--print", dest="lines", type=int, default=0, help="print N lines to each stream")
    args = p.parse_args()

    if os.environ.get("HOROLITE_PROBE_API") == "mpi4py":
        from mpi4py import MPI
        api, rank, size = "mpi4py", MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
        allreduce = None
    else:
        import numpy as np
        import horolite
        horolite.init()
        api, rank, size = "horolite", horolite.rank(), horolite.size()
        allreduce = float(horolite.allreduce(np.ones(3, np.float32), name="probe", op=horolite.Sum)[0])
    mark = {
        "rank": rank, "size": size, "api": api, "allreduce": allreduce, "pid": os.getpid(),
        "host": socket.gethostname(),
        "env": {k: v for k, v in os.environ.items()
                if k.startswith(("HOROLITE_", "HOROVOD_", "PROBE_"))},
        # What finding the same Python and libraries on another host depends on.
        "paths": {k: os.environ.get(k) for k in ("PATH", "VIRTUAL_ENV", "PYTHONPATH",
                                                 "LD_LIBRARY_PATH")},
        "executable": sys.executable,
    }
    tmp = os.path.join(args.outdir, f".{rank}.tmp")
    with open(tmp, "w") as f:
        json.dump(mark, f)
    os.replace(tmp, os.path.join(args.outdir, f"{rank}.json"))
    for i in range(args.lines):
        print(f"out line {i} of rank {rank}")
        print(f"err line {i} of rank {rank}", file=sys.stderr)
    sys.stdout.flush()

    if args.fail_rank == rank:
        time.sleep(0.3)
        if args.fail_how == "exit":
            sys.exit(args.fail_code)
        if args.fail_how == "hard-exit":  # no atexit, no MPI_Finalize: a rank that just dies
            os._exit(args.fail_code)
        if args.fail_how == "raise":
            raise RuntimeError(f"probe failure on rank {rank}")
        os.kill(os.getpid(), signal.SIGKILL)
    if args.sleep:
        # A rank that would wait forever for the failed one.
        deadline = time.time() + args.sleep
        while time.time() < deadline:
            time.sleep(0.1)
    if args.train and api == "horolite":
        deadline = time.time() + args.train
        step = 0
        while time.time() < deadline:
            horolite.allreduce(np.ones(1000, np.float32), name=f"grad{step % 4}")
            step += 1
    if api == "horolite":
        horolite.shutdown()


if __name__ == "__main__":
    main()
