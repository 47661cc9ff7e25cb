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


# What the Python wait ops must do as the native op does: every collective in graphs and
# tf.function, gradients, the one-op training step, and mismatches failing on every rank.
FALLBACK = {
    "test_tf_collectives.py": "wait_op or allreduce or allgather or broadcast or alltoall or "
                              "reducescatter or gradients or mismatch or indexed_slices",
    "test_tf_training.py": "graph_step or tape_data_parallel",
}


@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("name", sorted(FALLBACK))
def test_python_wait_ops_when_the_native_op_is_off(name, np_):
    # Where the native wait op cannot be built, graphs fall back to Python wait ops. The
    # ranks check the fallback is the op in their graphs (test_the_wait_op_in_graphs_...).
    env = dict(QUIET, HOROLITE_TF_NATIVE_OPS="0")
    run_pytest_file(os.path.join(ROOT, "tests", "tensorflow", name), np_, env=env,
                    timeout=300, pytest_args=["-k", FALLBACK[name]])
