"""The TensorFlow adapter tests under mpirun -np 1..4 (see tests/mpirun.py).

Each file in tests/tensorflow/ runs on every rank of a real mpirun; a rank's
failure fails the case and shows every rank's pytest log.
"""
import glob
import os

import pytest

from mpirun import RANK_COUNTS, ROOT, run_pytest_file

pytest.importorskip("tensorflow")

FILES = sorted(glob.glob(os.path.join(ROOT, "tests", "tensorflow", "test_*.py")))
QUIET = {"TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


@pytest.mark.parametrize("np_", RANK_COUNTS)
@pytest.mark.parametrize("path", FILES, ids=[os.path.basename(f) for f in FILES])
def test_tensorflow_rank_file(path, np_):
    run_pytest_file(path, np_, env=QUIET, timeout=300)


def test_python_wait_ops_when_the_native_op_is_off():
    # Where the native wait op cannot be built, graphs fall back to Python wait ops:
    # the same results, and mismatches still fail on every rank naming the tensor.
    env = dict(QUIET, HOROLITE_TF_NATIVE_OPS="0")
    run_pytest_file(os.path.join(ROOT, "tests", "tensorflow", "test_tf_collectives.py"), 2, env=env,
                    timeout=300, pytest_args=["-k", "mismatch or indexed_slices"])
