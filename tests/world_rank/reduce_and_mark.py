"""One rank of a job started without mpirun (tests/test_world_setup.py).

    python reduce_and_mark.py OUTDIR

init(), an allreduce, allgather and broadcast of known inputs checked against NumPy,
then OUTDIR/rank.<r> says "<rank> <size> <local_rank> <local_size> ok".
"""
import os
import sys

import numpy as np

import horolite as hvd

hvd.init()
r, n = hvd.rank(), hvd.size()
got = hvd.allreduce(np.arange(6, dtype=np.float64) * (r + 1), name="x", op=hvd.Sum)
assert np.array_equal(got, np.arange(6) * (n * (n + 1) // 2)), got
gathered = hvd.allgather(np.full((r + 1, 2), r, dtype=np.int32), name="g")
assert np.array_equal(gathered[:, 0], np.repeat(np.arange(n), np.arange(1, n + 1))), gathered
root = hvd.broadcast(np.full(3, r, dtype=np.float32), root_rank=n - 1, name="b")
assert (root == n - 1).all(), root
assert hvd.gloo_enabled() and not hvd.mpi_enabled()
with open(os.path.join(sys.argv[1], f"rank.{r}"), "w") as out:
    out.write(f"{r} {n} {hvd.local_rank()} {hvd.local_size()} ok")
