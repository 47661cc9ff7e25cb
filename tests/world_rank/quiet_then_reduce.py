"""One rank of a job without mpirun that goes quiet between two allreduces
(tests/test_world_setup.py): a pair of ranks silent longer than any set-up timeout
is not a lost one. The job's key has left the environment once the ranks met.

    python quiet_then_reduce.py OUTDIR SECONDS
"""
import os
import sys
import time

import numpy as np

import horolite as hvd

hvd.init()
r, n = hvd.rank(), hvd.size()
assert "HOROLITE_JOB_KEY" not in os.environ  # (what the script starts does not inherit it)
for step in range(2):
    if step:
        open(os.path.join(sys.argv[1], f"formed.{r}"), "w").close()
        time.sleep(float(sys.argv[2]))
    got = hvd.allreduce(np.full(4, r + step, dtype=np.float64), name=f"x{step}", op=hvd.Sum)
    assert np.array_equal(got, np.full(4, n * (n - 1) / 2 + n * step)), got
with open(os.path.join(sys.argv[1], f"rank.{r}"), "w") as out:
    out.write(f"{r} {n} quiet ok")
