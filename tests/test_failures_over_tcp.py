"""A rank that dies across (pretend) hosts, over horolite's TCP connections, under plain
mpirun: every survivor names it, and the survivors' logs say nothing else at ERROR.

Ranks far from the dead one (no connection to it: rank 1 of hosts 2+1+1 is on a host
with rank 0, and the ring and the hosts' control exchange pass it by) learn of the death
from the failure notice of a rank that saw the connection close (failure/channel.py,
runtime/job_end.py), never from their own neighbour leaving: that neighbour did nothing
wrong. A worker the dead rank forked keeps none of the job's connections, so its peers
see them close at once. Each rank runs under tests/failure_cases/hold.py, so mpirun's
clean-up after a death cannot end the survivors before they report.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from mpirun import ROOT, mpirun_command

CASES = os.path.join(ROOT, "tests", "failure_cases")
HOST = socket.gethostname()
# (layout, victim): at np 3 every rank is next to every other in the ring; at np 4 on
# 2+1+1 rank 1 has no connection to rank 3.
JOBS = {"np3": ("1+1+1", 2, "kill9"), "np4": ("2+1+1", 3, "kill9"),
        "np3-forked": ("1+1+1", 2, "kill9-forked"), "np3-raise": ("1+1+1", 2, "raise")}
_ran = {}


def run(job, tmp_path_factory):
    """Run JOBS[job] once (the tests below read the same job): (records, output, seconds)."""
    if job in _ran:
        return _ran[job]
    layout, victim, case = JOBS[job]
    np_ = sum(int(n) for n in layout.split("+"))
    out = tmp_path_factory.mktemp(job)
    env = dict(os.environ, HOROLITE_TEST_HOST_IDENTITY=layout,
               HOROLITE_CROSS_HOST_TRANSPORT="tcp", PYTHONUNBUFFERED="1")
    cmd = mpirun_command(np_) + [sys.executable, os.path.join(CASES, "hold.py"), str(out),
                                 str(np_ - 1), "30", "--", sys.executable,
                                 os.path.join(CASES, "tcp_kill.py"), str(out), str(victim), case]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
    seconds = time.monotonic() - start
    records = {}
    for r in range(np_):
        path = out / f"rank.{r}"
        if path.exists():
            records[r] = json.loads(path.read_text())
    died = float((out / "dies").read_text()) if (out / "dies").exists() else None
    _ran[job] = (np_, victim, records, died, output, seconds)
    return _ran[job]


@pytest.mark.parametrize("job", ["np3", "np4", "np3-forked"])
def test_every_survivor_names_the_rank_that_died(job, tmp_path_factory):
    np_, victim, records, died, output, _ = run(job, tmp_path_factory)
    tail = output[-4000:]
    assert died is not None, tail
    name = f"rank {victim} (host {HOST}~host{JOBS[job][0].count('+')})"
    for r in range(np_):
        if r == victim:
            continue
        assert r in records, f"rank {r} reported nothing\n{tail}"
        seen = records[r]
        assert seen.get("peer") == victim and name in seen["text"], (r, seen, tail)
        # Its connections closed at once (no worker of the dead rank kept them open).
        assert seen["at"] - died < 5, (r, seen["at"] - died, tail)


@pytest.mark.parametrize("job", ["np4", "np3-raise"])
def test_survivors_log_no_error_for_peers_leaving_a_failed_job(job, tmp_path_factory):
    np_, victim, records, died, output, _ = run(job, tmp_path_factory)
    assert len(records) == np_ - 1, output[-4000:]
    # (a killed rank's connection closing is the failure itself: said once, at ERROR)
    cause = f"connection to rank {victim} " if JOBS[job][2].startswith("kill9") else None
    for r in range(np_):
        if r == victim:
            continue
        noise = [line for line in output.splitlines()
                 if f"horolite rank {r}/{np_}]" in line and " ERROR " in line
                 and "connection to rank" in line and not (cause and cause in line)]
        assert not noise, (r, noise, output[-4000:])
