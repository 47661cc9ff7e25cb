"""Drive the GPU path's rank-side tests (tests/parallel/test_gpu.py) under mpirun with 1-4 ranks.

Without a GPU the device-parametrised collectives run on "cpu" and skip "cuda"
with the reason; the NCCL id exchange and device selection run for real.
"""
import os

import pytest

from mpirun import RANK_COUNTS, ROOT, run_pytest_file

PARALLEL = os.path.join(ROOT, "tests", "parallel")


@pytest.mark.parametrize("np_", RANK_COUNTS)
def test_gpu(np_):
    run_pytest_file(os.path.join(PARALLEL, "test_gpu.py"), np_, pytest_args=("-rs",))
