"""Helpers for the elastic end-to-end tests: read what tests/launcher_rank/elastic_train.py wrote."""
import glob
import os
import signal
import sys
import time

import numpy as np

from launcher_util import REPO

TRAIN = os.path.join(REPO, "tests", "launcher_rank", "elastic_train.py")
sys.path.insert(0, os.path.dirname(TRAIN))
import elastic_train  # noqa: E402


def steps_done(outdir, gen, rank=0):
    try:
        with open(os.path.join(outdir, f"steps.{gen}.{rank}")) as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def wait_for_steps(outdir, gen, count, proc, seconds=120):
    deadline = time.monotonic() + seconds
    while steps_done(outdir, gen) < count:
        assert proc.poll() is None, f"the job ended early:\n{proc.stderr.read()[-4000:]}"
        assert time.monotonic() < deadline, f"generation {gen} did not reach step {count}"
        time.sleep(0.05)


def kill9(outdir, gen, rank):
    """kill -9 of one rank's process (the training command, not its wrapper)."""
    with open(os.path.join(outdir, f"pid.{gen}.{rank}")) as f:
        os.kill(int(f.read()), signal.SIGKILL)
    return time.time()


def generations(outdir):
    return sorted({int(os.path.basename(p).split(".")[1])
                   for p in glob.glob(os.path.join(outdir, "pid.*"))})


def resumed(outdir, gen):
    """{rank: (step it resumed at, resets it saw)} for one generation."""
    found = {}
    for path in glob.glob(os.path.join(outdir, f"resumed.{gen}.*")):
        with open(path) as f:
            step, resets = f.read().split()
        found[int(path.rsplit(".", 1)[1])] = (int(step), int(resets))
    return found


def check_final(outdir, size, steps):
    """Every rank of the last generation holds the same weights, equal to NumPy's run."""
    finals = [np.load(os.path.join(outdir, f"final.{r}.npy")) for r in range(size)]
    for r, w in enumerate(finals):
        assert np.array_equal(w, finals[0]), f"rank {r} differs from rank 0: {w} vs {finals[0]}"
    np.testing.assert_allclose(finals[0], elastic_train.reference(steps), rtol=1e-12, atol=1e-12)
    assert not os.path.exists(os.path.join(outdir, f"final.{size}.npy"))


def first_step_time(outdir, gen):
    """When the first step of generation `gen` completed (rank 0's clock)."""
    with open(os.path.join(outdir, f"steps.{gen}.0")) as f:
        return float(f.readline().split()[4])


def commit_dirs():
    return set(glob.glob("/dev/shm/horolite-elastic-*"))
