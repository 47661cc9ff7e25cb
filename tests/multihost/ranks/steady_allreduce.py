"""Rank side: allreduces with checked results for SECONDS seconds after the first one
(a link may go down meanwhile). Rank 0 creates READY_FILE once the first step is done."""
import sys
import time

import numpy as np

import horolite as hvd

hvd.init()
seconds, ready = float(sys.argv[1]), sys.argv[2]
size = hvd.size()
step = 0
longest = 0.0  # the longest step: how long the ranks waited for a link that was down
deadline = None
while True:
    t0 = time.time()
    x = np.full(200_000, step + hvd.rank(), dtype=np.float32)  # 800 KB: several ring pieces
    got = hvd.allreduce(x, op=hvd.Sum, name=f"grad.{step % 3}")
    want = size * step + size * (size - 1) / 2
    if not np.all(got == want):
        sys.exit(f"step {step}: got {got[:3]} (and others), want {want}")
    step += 1
    if deadline is None:
        deadline = time.time() + seconds
        if hvd.rank() == 0:
            open(ready, "w").close()
    # Every rank stops at the same step: the decision is reduced too.
    go = hvd.allreduce(np.array([time.time() < deadline], dtype=np.int32), op=hvd.Min, name="go")
    if step > 1:
        longest = max(longest, time.time() - t0)
    if go[0] == 0:
        break
    time.sleep(0.01)
rank = hvd.rank()
print(f"rank {rank}: {step} steps checked, longest {longest:.1f} s", flush=True)
hvd.shutdown()
print(f"rank {rank}: shut down at {time.time():.3f}", flush=True)
