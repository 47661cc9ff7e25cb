"""A test-only switch: ranks that share one GPU use NCCL anyway.

NCCL refuses two ranks on one GPU, and horolite then stages device arrays
through host memory. To run the multi-rank NCCL matrix on a machine with one
GPU, `HOROLITE_TEST_NCCL_SHARED_GPU=1` (set on every rank by
tests/test_matrix_gpu.py) lets such ranks use NCCL, each rank given its own
NCCL_HOSTID so NCCL takes them for ranks on different hosts and talks between
them over its socket transport. Its speed means nothing. It is never a user
setting, so it is not declared in core/settings.py (names under
HOROLITE_TEST_ are the test harness's).
"""
from __future__ import annotations

import os

__all__ = ["SHARED_GPU_TEST_SWITCH", "shared_gpu_test_switch", "shared_gpu_host_id"]

SHARED_GPU_TEST_SWITCH = "HOROLITE_TEST_NCCL_SHARED_GPU"


def shared_gpu_test_switch(environ=os.environ) -> bool:
    """Whether this rank was started with the switch on ("1")."""
    return environ.get(SHARED_GPU_TEST_SWITCH, "").strip() == "1"


def shared_gpu_host_id(host: str, world_rank: int) -> str:
    """The NCCL_HOSTID a rank takes under the switch: its own, the same for all its sets."""
    return f"horolite-test-{host}-rank{world_rank}"
