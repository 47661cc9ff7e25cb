"""Rank side: 4 MiB allreduces in a loop, results checked, until killed or SECONDS pass.
After its first step each rank writes OUTDIR/<rank>.pid (its pid as its host numbers it)
and OUTDIR/<rank>.shm (the /dev/shm files it maps: what must not outlive the job)."""
import os
import sys
import time

import numpy as np

import horolite as hvd
from horolite.failure.shm_files import mapped_shm_files

hvd.init()
outdir, seconds = sys.argv[1], float(sys.argv[2])
size, rank = hvd.size(), hvd.rank()
deadline = time.time() + seconds
step = 0
while time.time() < deadline:
    x = np.full(1 << 20, step + rank, dtype=np.float32)  # 4 MiB
    got = hvd.allreduce(x, op=hvd.Sum, name=f"grad.{step % 4}")
    want = size * step + size * (size - 1) / 2
    if not np.all(got == want):
        sys.exit(f"step {step}: got {got[:3]} (and others), want {want}")
    if step == 0:
        with open(os.path.join(outdir, f"{rank}.shm"), "w") as f:
            f.write("\n".join(sorted(mapped_shm_files(os.getpid()))))
        tmp = os.path.join(outdir, f".{rank}.tmp")
        with open(tmp, "w") as f:
            f.write(str(os.getpid()))
        os.replace(tmp, os.path.join(outdir, f"{rank}.pid"))
    step += 1
print(f"rank {rank}: {step} steps", flush=True)
hvd.shutdown()
