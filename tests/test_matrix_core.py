"""Drive the core runtime's rank-side tests under a real mpirun with 1, 2, 3 and 4 ranks."""
import os

import pytest

from mpirun import RANK_COUNTS, ROOT, run_pytest_file

PARALLEL = os.path.join(ROOT, "tests", "parallel")

VARIANTS = {
    "default": {},
    "nocache-nofusion": {"HOROLITE_CACHE_CAPACITY": "0", "HOROLITE_FUSION_THRESHOLD": "0"},
    # A tiny fusion buffer and cache: the big tensors exceed it, evictions happen.
    "smallfusion-smallcache": {"HOROLITE_FUSION_THRESHOLD": "65536", "HOROLITE_CACHE_CAPACITY": "7",
                               "HOROVOD_CYCLE_TIME": "2"},
}


@pytest.mark.parametrize("np_", RANK_COUNTS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_collectives(np_, variant):
    run_pytest_file(os.path.join(PARALLEL, "test_collectives.py"), np_, VARIANTS[variant])


@pytest.mark.parametrize("np_", RANK_COUNTS)
def test_errors(np_):
    run_pytest_file(os.path.join(PARALLEL, "test_errors.py"), np_)


@pytest.mark.parametrize("np_", RANK_COUNTS)
def test_lifecycle(np_):
    run_pytest_file(os.path.join(PARALLEL, "test_lifecycle.py"), np_)
