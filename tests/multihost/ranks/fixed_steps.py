"""Rank side: STEPS allreduces of several sizes (a small one, one of several ring pieces),
each result checked against the sum every rank's known input makes; then
"rank r: STEPS steps"."""
import sys

import numpy as np

import horolite as hvd

hvd.init()
steps = int(sys.argv[1])
size, rank = hvd.size(), hvd.rank()
for step in range(steps):
    for n in (7, 300_000):
        x = np.full(n, step + rank, dtype=np.float32)
        got = hvd.allreduce(x, op=hvd.Sum, name=f"grad.{n}")
        want = sum(step + r for r in range(size))
        if not np.all(got == want):
            sys.exit(f"step {step}: got {got[:3]} (and others), want {want}")
print(f"rank {rank}: {steps} steps", flush=True)
hvd.shutdown()
