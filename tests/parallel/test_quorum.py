"""allreduce(..., quorum=k): done once k ranks have submitted, on the real runtime.

Runs on every rank under mpirun (tests/test_matrix_core.py). The slow rank is
made late for certain, not by sleeping: it waits for a file rank 0 writes once
the decision it must miss is made, so which ranks contribute is known.
Results are checked against NumPy from every rank's known inputs.
"""
import os
import re
import tempfile
import time

import numpy as np
import pytest

import horolite as hvd
from horolite.core.mpi_library import MPI  # the job world's: mpi4py's under mpirun

hvd.init()
COMM = MPI.COMM_WORLD
RANK, SIZE = hvd.rank(), hvd.size()
LAST = SIZE - 1
# The marker files' folder: the driver's, or a fresh one rank 0 makes (never /tmp itself,
# where an earlier run's markers would make the late rank not late).
OUTDIR = os.environ.get("HOROLITE_TEST_OUTDIR") or COMM.bcast(
    tempfile.mkdtemp(prefix="horolite-markers-") if COMM.Get_rank() == 0 else None)


def inputs(rank, step, shape=(5,)):
    return (np.arange(np.prod(shape), dtype=np.float64).reshape(shape) + 10 * rank + step) * (rank + 1)


def mark(tag):
    open(os.path.join(OUTDIR, f"quorum.{tag}"), "w").close()


def wait_for(tag, timeout=60):
    path = os.path.join(OUTDIR, f"quorum.{tag}")
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"rank {RANK}: no {path} after {timeout} s"
        time.sleep(0.005)


def same_everywhere(values, name):
    """values (a tuple of ints) is the same on every rank (gathered by mpi4py, not horolite)."""
    every = COMM.allgather(tuple(int(v) for v in values))
    assert all(other == every[RANK] for other in every), f"{name}: {every}"


def test_quorum_of_all_is_allreduce():
    h = hvd.allreduce_async(inputs(RANK, 0), name="q.all", quorum=SIZE)
    got = hvd.synchronize(h)
    np.testing.assert_allclose(got, np.mean([inputs(r, 0) for r in range(SIZE)], axis=0))
    assert h.contributors == tuple(range(SIZE))


@pytest.mark.parametrize("op", [hvd.Average, hvd.Sum])
def test_late_rank_is_dropped_and_gets_the_same_results(op):
    """The last rank submits each of 3 steps only after the other ranks' quorum
    decided it: its inputs never count, and it gets every step's result, in order."""
    k = max(SIZE - 1, 1)
    steps = 3
    tag = f"late.{int(op)}"
    results, contributors = [], []
    for step in range(steps):
        if RANK == LAST and SIZE > 1:
            wait_for(f"{tag}.{steps - 1}")  # all 3 decided without this rank
        h = hvd.allreduce_async(inputs(RANK, step), op=op, name="q.late", quorum=k,
                                prescale_factor=0.5)
        results.append(hvd.synchronize(h))
        contributors.append(h.contributors)
        if RANK == 0:
            mark(f"{tag}.{step}")
    want_ranks = tuple(range(k))
    for step in range(steps):
        assert contributors[step] == want_ranks
        want = 0.5 * np.sum([inputs(r, step) for r in want_ranks], axis=0)
        if op == hvd.Average:
            want /= k
        np.testing.assert_allclose(results[step], want)
    same_everywhere([c for cs in contributors for c in cs], f"q.late.ranks.{int(op)}")


def test_grouped_quorum_is_one_decision():
    k = max(SIZE - 1, 1)
    if RANK == LAST and SIZE > 1:
        wait_for("grouped")
    shapes = [(3,), (2, 2), ()]
    h = hvd.grouped_allreduce_async([inputs(RANK, i, s).astype(np.float32) for i, s in enumerate(shapes)],
                                    op=hvd.Sum, name="q.group", quorum=k)
    got = hvd.synchronize(h)
    if RANK == 0:
        mark("grouped")
    assert h.contributors == tuple(range(k))
    for i, s in enumerate(shapes):
        want = np.sum([inputs(r, i, s) for r in range(k)], axis=0)
        assert got[i].shape == s and got[i].dtype == np.float32
        np.testing.assert_allclose(got[i], want, rtol=1e-6)


def test_contributors_are_the_same_on_every_rank_when_all_race():
    """No rank is held back: whichever ranks count, every rank agrees and the
    result is the mean of exactly their inputs."""
    k = (SIZE + 1) // 2
    for step in range(5):
        h = hvd.allreduce_async(inputs(RANK, step), name="q.race", quorum=k)
        got = hvd.synchronize(h)
        assert len(h.contributors) == k
        np.testing.assert_allclose(got, np.mean([inputs(r, step) for r in h.contributors], axis=0))
        same_everywhere(h.contributors, f"q.race.ranks.{step}")


def test_bad_arguments_are_refused_on_the_caller():
    for q in (0, SIZE + 1, 1.5, True):
        with pytest.raises(hvd.InvalidCollectiveError, match=r"tensor 'q.bad': quorum must be"):
            hvd.allreduce(np.ones(2), name="q.bad", quorum=q)
    with pytest.raises(hvd.InvalidCollectiveError, match=r"supports Average and Sum, not Max"):
        hvd.allreduce(np.ones(2), op=hvd.Max, name="q.bad", quorum=1)
    with pytest.raises(hvd.InvalidCollectiveError, match=r"host arrays of one dtype"):
        hvd.grouped_allreduce([np.ones(2), np.ones(2, np.float32)], name="q.badgroup", quorum=1)
    np.testing.assert_allclose(hvd.allreduce(np.ones(2), name="q.after.bad"), np.ones(2))


def test_mismatch_among_the_quorum_is_an_error_on_every_rank():
    shape = (2,) if RANK == 0 else (3,)
    if SIZE == 1:
        pytest.skip("one rank cannot disagree")
    with pytest.raises(hvd.TensorMismatchError, match=r"tensor 'q.mismatch': mismatched shape: "
                                                      r"rank 0 had \(2,\), ranks? 1"):
        hvd.allreduce(np.ones(shape), name="q.mismatch", quorum=SIZE)
    np.testing.assert_allclose(hvd.allreduce(np.ones(2), name="q.after.mismatch"), np.ones(2))


def test_late_submission_that_differs_names_the_rank():
    if SIZE == 1:
        pytest.skip("needs a late rank")
    if RANK == LAST:
        wait_for("latebad")
        with pytest.raises(hvd.TensorMismatchError,
                           match=rf"tensor 'q.latebad': rank {LAST} submitted float64 \(4,\) .*"
                                 r"after the quorum of ranks 0.* float64 \(3,\)"):
            hvd.allreduce(np.ones(4), name="q.latebad", quorum=SIZE - 1)
    else:
        hvd.allreduce(np.ones(3), name="q.latebad", quorum=SIZE - 1)
        if RANK == 0:
            mark("latebad")
    np.testing.assert_allclose(hvd.allreduce(np.ones(2), name="q.after.latebad"), np.ones(2))


def test_quorum_counts_among_ranks_that_have_not_joined():
    if SIZE == 1:
        pytest.skip("needs a joined rank")
    if RANK == LAST:
        assert hvd.join() in range(SIZE)
        return
    h = hvd.allreduce_async(inputs(RANK, 0), name="q.joined", quorum=SIZE)  # needs SIZE-1 here
    got = hvd.synchronize(h)
    assert h.contributors == tuple(range(SIZE - 1))
    np.testing.assert_allclose(got, np.mean([inputs(r, 0) for r in range(SIZE - 1)], axis=0))
    hvd.join()


STRAGGLER_STEPS = 4


def test_a_straggler_finishes_its_decided_steps_after_the_others_left():
    """Last in this file: the other ranks finish all steps and shut down while the last
    rank is still STRAGGLER_STEPS steps behind. Every step was decided without it, so it
    gets every result (checked against NumPy) after they left; a collective nobody
    decided fails at once naming the rank that left, never hangs."""
    if SIZE == 1:
        pytest.skip("needs a straggler")
    k = SIZE - 1
    want = [np.mean([inputs(r, step) for r in range(k)], axis=0) for step in range(STRAGGLER_STEPS)]
    if RANK != LAST:
        for step in range(STRAGGLER_STEPS):
            h = hvd.allreduce_async(inputs(RANK, step), name="q.straggler", quorum=k)
            np.testing.assert_allclose(hvd.synchronize(h), want[step])
            assert h.contributors == tuple(range(k))
        hvd.shutdown()
        mark(f"left.{RANK}")
        return
    for q in range(k):
        wait_for(f"left.{q}")
    for step in range(STRAGGLER_STEPS):
        h = hvd.allreduce_async(inputs(RANK, step), name="q.straggler", quorum=k)
        np.testing.assert_allclose(hvd.synchronize(h), want[step])
        assert h.contributors == tuple(range(k))
    # Every other rank left; whichever shutdown reached this rank first is the one named.
    with pytest.raises(hvd.HorovodInternalError,
                       match=r"tensor 'q.never': horolite was shut down: rank (\d+) \(host [^)]+\) called shutdown\(\) "
                             r"before this collective completed on every rank") as failed:
        hvd.allreduce(inputs(RANK, 0), name="q.never", quorum=k)
    named = re.search(r"rank (\d+) \(host", str(failed.value)).group(1)
    assert int(named) in range(k), str(failed.value)
