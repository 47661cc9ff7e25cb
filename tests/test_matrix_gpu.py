"""Drive the GPU path's rank-side tests (tests/parallel/test_gpu.py) under mpirun with 1-4 ranks.

Without a GPU the device-parametrised collectives run on "cpu" and skip "cuda"
with the reason; the NCCL id exchange and device selection run for real.

On a machine with one GPU, the "shared-gpu-nccl" runs set the test-only switch
HOROLITE_TEST_NCCL_SHARED_GPU=1 (transport/nccl.py): every rank uses NCCL on
the one GPU, each with its own NCCL host id, so every device case runs over
NCCL at np 1-4. The "as-users-run" runs leave it unset, as a user would.
"""
import os

import pytest

from mpirun import RANK_COUNTS, ROOT, run_pytest_file

from horolite.core.device import cuda_device_count, nccl_status

PARALLEL = os.path.join(ROOT, "tests", "parallel")


@pytest.mark.parametrize("mode", ["as-users-run", "shared-gpu-nccl"])
@pytest.mark.parametrize("np_", RANK_COUNTS)
def test_gpu(np_, mode):
    env = {}
    if mode == "shared-gpu-nccl":
        ok, why = nccl_status()
        if not ok:
            pytest.skip(f"the shared-GPU NCCL runs need NCCL here: {why}")
        if np_ <= cuda_device_count():
            pytest.skip(f"{cuda_device_count()} GPUs: np {np_} has a GPU per rank without the switch")
        env["HOROLITE_TEST_NCCL_SHARED_GPU"] = "1"
    run_pytest_file(os.path.join(PARALLEL, "test_gpu.py"), np_, env=env, pytest_args=("-rs",))
