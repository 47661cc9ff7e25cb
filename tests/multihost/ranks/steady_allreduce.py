"""Rank side: allreduces with checked results for SECONDS seconds (a link may go down meanwhile)."""
import sys
import time

import numpy as np

import horolite as hvd

hvd.init()
seconds = float(sys.argv[1])
size = hvd.size()
deadline = time.time() + seconds
step = 0
while time.time() < deadline:
    x = np.full(200_000, step + hvd.rank(), dtype=np.float32)  # 800 KB: several ring pieces
    got = hvd.allreduce(x, op=hvd.Sum, name=f"grad.{step % 3}")
    want = size * step + size * (size - 1) / 2
    if not np.all(got == want):
        sys.exit(f"step {step}: got {got[:3]} (and others), want {want}")
    step += 1
    time.sleep(0.01)
print(f"rank {hvd.rank()}: {step} steps checked", flush=True)
hvd.shutdown()
