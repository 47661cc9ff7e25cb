"""The TensorFlow adapter tests under mpirun -np 1..4 (see tests/mpirun.py).

Each file in tests/tensorflow/ runs on every rank of a real mpirun; a rank's
failure fails the case and shows every rank's pytest log.
"""
import glob
import os

import pytest

from mpirun import RANK_COUNTS, ROOT, run_pytest_file

pytest.importorskip("tensorflow")

BUCKETS = os.path.join(ROOT, "tests", "tensorflow", "test_tf_buckets.py")
FILES = sorted(f for f in glob.glob(os.path.join(ROOT, "tests", "tensorflow", "test_*.py"))
               if f != BUCKETS)
QUIET = {"TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


# The adapters' own files at np 1-4: training (tape, legacy and Keras optimizers, fit) and
# the collectives. The other files (Adasum, the buckets' traces and guarantees, process
# sets, stragglers, SyncBatchNormalization, ...) each at one size, 2 or 3 in turn (the
# buckets themselves run at np 2, 3 and 4 below): their features meet no path at one size that the other does not take (the
# rings and trees under them are the runtime's, run at np 1-4 in test_matrix_core.py), and
# a job of TensorFlow processes on CI's 2 cores takes a minute or more.
EVERY_SIZE = ("test_tf_training.py", "test_tf_collectives.py")
OTHERS = [f for f in FILES if os.path.basename(f) not in EVERY_SIZE]


# (the traces' file traces models of many variables: at np 3 on CI's 2 cores it took 107 s)
AT_TWO = ("test_tf_bucket_traces.py",)


def _sizes(path):
    name = os.path.basename(path)
    if name in EVERY_SIZE:
        return RANK_COUNTS
    if name in AT_TWO:
        return (2,)
    return (3,) if OTHERS.index(path) % 2 == 0 else (2,)


JOBS = [(f, n) for f in FILES for n in _sizes(f)]


@pytest.mark.parametrize("path,np_", JOBS, ids=[f"{os.path.basename(f)}-{n}" for f, n in JOBS])
def test_tensorflow_rank_file(path, np_):
    run_pytest_file(path, np_, env=QUIET, timeout=300)


# Gradient buckets (test_tf_buckets.py): (np, environment, whether buckets are expected).
# Set explicitly at np 3; by default none on one host (np 2: the checks of which path the
# step took, and one training case), and buckets where ranks span (pretend) hosts (np 4;
# 1+1 in test_matrix_gloo.py, and 2 x 1 simulated hosts in tests/multihost).
BUCKET_RUNS = {
    "cap_np3": (3, {"HOROLITE_GRADIENT_BUCKET_MB": "0.3"}, True),
    "one_host_default_np2": (2, {}, False),
    "hosts_2+2_np4": (4, {"HOROLITE_TEST_HOST_IDENTITY": "2+2"}, True),
}
ONE_HOST = ("the_run_has_the_bucketing or tape_buckets_average_like_numpy "
            "or exchange_lane_where_the_driver")
# The cap and the layout across hosts change how variables fall into buckets, not how a
# dtype is reduced (every float dtype runs at np 2 on one host, and under --gloo at 1+1).
FLOAT32_ONLY = "not float16 and not float64"


@pytest.mark.parametrize("run", sorted(BUCKET_RUNS))
def test_gradient_buckets(run):
    np_, env, expect = BUCKET_RUNS[run]
    args = ["-k", FLOAT32_ONLY] if expect else ["-k", ONE_HOST]
    lane = "HOROLITE_TEST_HOST_IDENTITY" in env  # `auto`: the exchange lane across hosts
    run_pytest_file(BUCKETS, np_, env=dict(QUIET, HOROLITE_TEST_EXPECT_BUCKETS=str(int(expect)),
                                           HOROLITE_TEST_EXPECT_LANE=str(int(lane)), **env),
                    timeout=300, pytest_args=args)


# What the Python wait ops must do as the native op does: every collective in graphs and
# tf.function, gradients, the one-op training step, and mismatches failing on every rank.
FALLBACK = {
    "test_tf_collectives.py": "wait_op or allreduce or allgather or broadcast or alltoall or "
                              "reducescatter or gradients or mismatch or indexed_slices",
    "test_tf_training.py": "graph_step or tape_data_parallel",
}


@pytest.mark.parametrize("name,np_", [("test_tf_collectives.py", 3), ("test_tf_training.py", 2)])
def test_python_wait_ops_when_the_native_op_is_off(name, np_):
    # Where the native wait op cannot be built, graphs fall back to Python wait ops. The
    # ranks check the fallback is the op in their graphs (test_the_wait_op_in_graphs_...).
    env = dict(QUIET, HOROLITE_TF_NATIVE_OPS="0")
    run_pytest_file(os.path.join(ROOT, "tests", "tensorflow", name), np_, env=env,
                    timeout=300, pytest_args=["-k", FALLBACK[name]])
