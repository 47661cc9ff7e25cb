"""Elastic jobs under Slurm: the allocation is the pool. A rank killed on hl-node2 gets that
node blacklisted, and the job goes on on hl-node1 from the last commit (NumPy's result)."""
import os
import re
import signal
import sys
import time

from test_slurm import LAUNCHER, PYTHON, sbatch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "launcher"))
from elastic_util import TRAIN, check_final, generations, resumed, steps_done  # noqa: E402


def test_a_node_whose_rank_was_killed_is_left_out_and_training_goes_on(slurm, jobdir):
    out = jobdir / "out"
    job = sbatch(slurm, jobdir, 4, f"{LAUNCHER} --min-np 2 {PYTHON} {TRAIN} {out} --steps 30 "
                                   "--commit-every 5 --sleep 0.1")
    deadline = time.monotonic() + 180
    while steps_done(out, 0) < 8:
        assert time.monotonic() < deadline, (jobdir / "job.out").read_text()[-3000:]
        time.sleep(0.1)
    with open(out / "pid.0.3") as f:  # rank 3: the second task on hl-node2
        os.kill(int(f.read()), signal.SIGKILL)
    state = slurm.wait_job(job, seconds=240)
    output = (jobdir / "job.out").read_text()
    assert state == "COMPLETED", output[-4000:]
    assert generations(out) == [0, 1], output[-3000:]
    assert re.search(r"generation 0 failed \(rank 3 \(host [^,]+, pid \d+\) was killed by signal 9 "
                     r"\(SIGKILL\)\); blacklisted hl-node2",
                     output), output[-3000:]
    assert "generation 1: 2 ranks on hl-node1:2" in output, output[-3000:]
    (step, resets), = set(resumed(out, 1).values())
    assert step in (5, 10) and resets == 1
    check_final(out, 2, 30)
