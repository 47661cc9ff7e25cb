"""Failures that explain themselves: bad input swept on 2 ranks under a real mpirun."""
import os

import pytest

from mpirun import ROOT, run_pytest_file

PARALLEL = os.path.join(ROOT, "tests", "parallel")


@pytest.mark.parametrize("np_", [2])
def test_dtype_sweep(np_):
    run_pytest_file(os.path.join(PARALLEL, "test_dtype_sweep.py"), np_)
