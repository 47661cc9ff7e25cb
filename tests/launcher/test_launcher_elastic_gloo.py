"""Elastic jobs without MPI end to end on this host: real horolite-run --gloo, real kill -9,
survivors that go on in their running processes.

The rank program (tests/launcher_rank/elastic_in_process.py) trains least squares with a
result independent of the number of ranks, so every run is checked against NumPy. The
multi-host cases are in tests/multihost/test_multihost_elastic_gloo.py.
"""
import os
import re
import signal
import sys
import time

import numpy as np
import pytest

from elastic_util import elastic_train
from launcher_util import REPO, wait_until_gone

IN_PROCESS = os.path.join(REPO, "tests", "launcher_rank", "elastic_in_process.py")
NO_MPI = {"HOROLITE_MPIRUN": "/nonexistent/mpirun"}


def lines(outdir, kind, worker):
    try:
        with open(os.path.join(outdir, f"{kind}.{worker}")) as f:
            return [line.split() for line in f]
    except OSError:
        return []


def pid(outdir, worker):
    with open(os.path.join(outdir, f"pid.{worker}")) as f:
        return int(f.read())


def wait_for_step(outdir, worker, step, proc, seconds=90):
    deadline = time.monotonic() + seconds
    while not any(int(s[3]) >= step for s in lines(outdir, "steps", worker)):
        assert proc.poll() is None, f"the job ended early:\n{proc.stderr.read()[-4000:]}"
        assert time.monotonic() < deadline, f"{worker} did not reach step {step}"
        time.sleep(0.02)


def check_final(outdir, workers, steps):
    """Every listed worker holds the same weights, equal to NumPy's run."""
    finals = {w: np.load(os.path.join(outdir, f"final.{w}.npy")) for w in workers}
    first = finals[workers[0]]
    for w, got in finals.items():
        assert np.array_equal(got, first), f"{w} differs from {workers[0]}: {got} vs {first}"
    np.testing.assert_allclose(first, elastic_train.reference(steps), rtol=1e-12, atol=1e-12)


def recovery_seconds(outdir, worker, killed_at):
    """From the kill to this worker's first step in the next generation."""
    after = [float(s[4]) for s in lines(outdir, "steps", worker) if s[0] != "0"]
    return after[0] - killed_at


@pytest.mark.parametrize("np_,victim", [(2, 0), (3, 1), (4, 1)])
def test_kill9_survivors_go_on_in_their_running_processes(start, tmp_path, np_, victim):
    proc = start("--gloo", "-np", np_, "--min-np", np_ - 1, sys.executable, IN_PROCESS,
                 tmp_path, "--steps", 60, "--commit-every", 3, "--sleep", 0.05, env=NO_MPI)
    wait_for_step(tmp_path, f"w{victim}", 12, proc)
    killed_at = time.time()
    os.kill(pid(tmp_path, f"w{victim}"), signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-4000:]
    assert re.search(rf"generation 0: rank {victim} \(w{victim}, host localhost\) was killed by "
                     rf"signal 9 \(SIGKILL\); generation 1: {np_ - 1} rank\(s\) go on in their "
                     "running processes", err), err[-3000:]
    survivors = [f"w{k}" for k in range(np_) if k != victim]
    for w in survivors:
        # One reset, in the process that started: nothing was started again.
        assert lines(tmp_path, "resets", w) == [["1", str(np_ - 1), str(pid(tmp_path, w))]], w
        steps = lines(tmp_path, "steps", w)
        assert {(s[0], s[2]) for s in steps} == {("0", str(np_)), ("1", str(np_ - 1))}, w
        first_after = next(int(s[3]) for s in steps if s[0] == "1")
        last_before = max(int(s[3]) for s in steps if s[0] == "0")
        assert first_after % 3 == 1 and last_before - 3 < first_after <= last_before + 1, \
            (w, last_before, first_after)  # resumed from the last commit
    # The oldest survivor is rank 0 of the new world, the others keep their order.
    assert [lines(tmp_path, "steps", w)[-1][1] for w in survivors] == \
        [str(r) for r in range(np_ - 1)]
    check_final(tmp_path, survivors, 60)
    assert not os.path.exists(tmp_path / f"final.w{victim}.npy")
    print(f"np {np_}: from kill -9 to the survivors' next step: "
          f"{recovery_seconds(tmp_path, survivors[0], killed_at):.2f} s")
    assert not wait_until_gone(str(tmp_path), 5)
