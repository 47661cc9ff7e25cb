"""Jobs started without MPI (horolite-run --gloo, horolite/world/): a subset of the core and
TensorFlow matrices that reaches every path of the sockets world, and the failures.

The subset: every collective at np 1-4 through shared memory; the ring over the world's
own messages on one host; horolite's TCP connections across pretend hosts (the
hierarchical and cross-host paths); the world's messages across pretend hosts (the
host leaders' control exchange); errors, lifecycle, process sets, the caller's-thread
small collectives, stragglers, the exchange lane, quorum and Adasum; TensorFlow training and
buckets. Every other feature's matrix runs under mpirun (the runtime above the world is
the same code). (An exception on one rank: test_failures.py, in both worlds.)
"""
import os
import re

import pytest

from mpirun import ROOT, RANK_COUNTS, run_pytest_file
from test_failures import HOST, lines_of, run_job

PARALLEL = os.path.join(ROOT, "tests", "parallel")
TENSORFLOW = os.path.join(ROOT, "tests", "tensorflow")

JOBS = [(PARALLEL, "test_collectives.py", n, {}) for n in RANK_COUNTS] + [
    # the rings over the world's own messages (no shared memory)
    (PARALLEL, "test_collectives.py", 3, {"HOROLITE_SHARED_MEMORY": "0"}),
    # across pretend hosts over horolite's TCP connections: hierarchical, control leaders
    (PARALLEL, "test_collectives.py", 4, {"HOROLITE_TEST_HOST_IDENTITY": "2+2"}),
    # across pretend hosts over the world's messages (what MPI carries in an MPI job)
    (PARALLEL, "test_collectives.py", 3, {"HOROLITE_TEST_HOST_IDENTITY": "1+2",
                                          "HOROLITE_CROSS_HOST_TRANSPORT": "mpi"}),
    (PARALLEL, "test_errors.py", 2, {}),
    (PARALLEL, "test_errors.py", 3, {}),
    (PARALLEL, "test_lifecycle.py", 3, {}),
    (PARALLEL, "test_process_sets.py", 3, {}),
    (PARALLEL, "test_process_sets.py", 4, {"HOROLITE_SHARED_MEMORY": "0"}),
    (PARALLEL, "test_small_collectives.py", 3, {"HOROLITE_TEST_EXPECT_BOARD": "1"}),
    (PARALLEL, "test_stragglers.py", 3, {"HOROLITE_STRAGGLER_REPORT_SECONDS": "2"}),
    (PARALLEL, "test_exchange_lane.py", 3, {"HOROLITE_EXCHANGE_PIPELINE": "1",
                                            "HOROLITE_SHARED_MEMORY": "0"}),
    (PARALLEL, "test_quorum.py", 3, {}),
    (PARALLEL, "test_adasum.py", 4, {}),
    (TENSORFLOW, "test_tf_training.py", 3, {"TF_CPP_MIN_LOG_LEVEL": "3"}),
    # across pretend hosts: buckets on the exchange lane, over horolite's TCP connections
    (TENSORFLOW, "test_tf_buckets.py", 2, {"HOROLITE_TEST_HOST_IDENTITY": "1+1",
                                           "HOROLITE_TEST_EXPECT_BUCKETS": "1",
                                           "HOROLITE_TEST_EXPECT_LANE": "1",
                                           "TF_CPP_MIN_LOG_LEVEL": "3"}),
]


def _id(job):
    _, name, n, env = job
    extra = "-".join(f"{k.replace('HOROLITE_', '').lower()}={v}" for k, v in env.items()
                     if not k.startswith(("HOROLITE_TEST_EXPECT", "TF_CPP")))
    return f"{name[:-3]}-np{n}" + (f"-{extra}" if extra else "")


@pytest.mark.parametrize("job", JOBS, ids=[_id(j) for j in JOBS])
def test_rank_file_without_mpi(job):
    folder, name, n, env = job
    if folder == TENSORFLOW:
        pytest.importorskip("tensorflow")
        env = dict(env, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run_pytest_file(os.path.join(folder, name), n, env, world="gloo", timeout=300)


def test_a_rank_killed_with_sigkill_is_named(tmp_path):
    proc = run_job("kill9", 3, tmp_path, world="gloo")
    assert proc.returncode != 0
    summary = [line for line in proc.stderr.splitlines() if line.startswith("horolite-run: job")]
    assert len(summary) == 1 and re.search(r"rank 2 \(host [^)]*\) was killed by signal 9",
                                           summary[0]), proc.stderr[-3000:]


def test_a_frozen_rank_is_named_on_every_rank_and_ends_the_job(tmp_path):
    np_ = 3
    proc = run_job("sigstop", np_, tmp_path, timeout=180, world="gloo", env={
        "HOROLITE_SHARED_MEMORY": "0", "HOROLITE_STALL_CHECK_TIME_SECONDS": "1",
        "HOROLITE_STALL_SHUTDOWN_TIME_SECONDS": "3"})
    assert proc.returncode != 0
    silent = re.compile(rf"no word from rank {np_ - 1} \(host {re.escape(HOST)}\) for (\d+) s "
                        r"\(HOROLITE_STALL_SHUTDOWN_TIME_SECONDS=3\); shutting the job down")
    for r in range(np_ - 1):
        seen = [int(m.group(1)) for m in map(silent.search, lines_of(proc.out, r, np_)) if m]
        assert seen and min(seen) >= 3, proc.out[-3000:]
