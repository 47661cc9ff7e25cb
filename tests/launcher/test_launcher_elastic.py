"""Elastic jobs end to end on this host: real horolite-run, real mpirun, real kill -9.

The rank program (tests/launcher_rank/elastic_train.py) trains least squares with
a result independent of the number of ranks, so every run is checked against a
NumPy reference. One host: a blacklisted localhost comes back after
--blacklist-cooldown-range 1 1 (1 s); the multi-host cases are in tests/multihost.
"""
import os
import re
import shutil
import sys

import pytest

from elastic_util import (TRAIN, check_final, commit_dirs, generations, kill9, resumed,
                          wait_for_steps)

pytestmark = pytest.mark.skipif(
    shutil.which("mpirun", path=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    is None, reason="no mpirun installed")

COOLDOWN = ("--blacklist-cooldown-range", "1", "1")


@pytest.mark.parametrize("np_", [1, 2, 3, 4])
def test_kill9_of_a_rank_restarts_from_the_last_commit(np_, start, tmp_path):
    before = commit_dirs()
    proc = start("-np", np_, "--min-np", np_, "-H", f"localhost:{np_}", *COOLDOWN, sys.executable,
                 TRAIN, tmp_path, "--steps", 30, "--commit-every", 5, "--sleep", 0.1)
    wait_for_steps(tmp_path, 0, 12, proc)
    kill9(tmp_path, 0, np_ - 1)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-4000:]
    assert generations(tmp_path) == [0, 1], err[-3000:]
    # Killed after step 12: every rank resumed at the commit of step 10 (or 15, if the
    # kill landed after it), as one more reset.
    again = resumed(tmp_path, 1)
    assert sorted(again) == list(range(np_))
    assert {v for v in again.values()} in ({(10, 1)}, {(15, 1)}), again
    assert re.search(rf"rank {np_ - 1} \(host [^,]+, pid \d+\) was killed by signal 9 \(SIGKILL\)\); "
                     r"blacklisted localhost", err), err[-3000:]
    check_final(tmp_path, np_, 30)
    assert commit_dirs() <= before, "the job's commits were left in /dev/shm"


def test_the_restart_log_names_a_rank_that_is_persistently_last(start, tmp_path):
    # Rank 2 sleeps 100 ms more than the others before every allreduce; rank 1 is killed.
    # (3 ranks on 2 cores: the others' own lateness takes 10-15 ms off the measured wait,
    # which a 60 ms delay could not keep within 20%.) Every fifth step's commit adds a
    # collective where rank 2 is not held back, and a 2 s window holds about 20
    # collectives: its share is about 85%, seen as low as 78%; chance would be 33%.
    proc = start("-np", 3, "--min-np", 3, "-H", "localhost:3", *COOLDOWN, sys.executable,
                 TRAIN, tmp_path, "--steps", 40, "--commit-every", 5, "--sleep", 0.02,
                 "--slow-rank", 2, "--slow-seconds", 0.1,
                 env={"HOROLITE_STRAGGLER_REPORT_SECONDS": "2"})
    wait_for_steps(tmp_path, 0, 30, proc)
    kill9(tmp_path, 0, 1)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-4000:]
    assert generations(tmp_path) == [0, 1], err[-3000:]
    named = re.search(r"generation 0: rank (\d) \(host [^)]+\) was last in (\d+)% of "
                      r"collectives over the last \d+ s; the others waited (\d+) ms", err)
    assert named, err[-3000:]
    rank, share, waited = map(int, named.groups())
    assert rank == 2 and share >= 65 and abs(waited - 100) <= 20, named.group(0)
    assert "not evicted" in err
    assert sorted(resumed(tmp_path, 1)) == [0, 1, 2]  # rank 2 still in the job
    check_final(tmp_path, 3, 40)


def test_reset_limit_caps_restarts(start, tmp_path):
    proc = start("-np", 2, "--min-np", 2, "-H", "localhost:2", *COOLDOWN, "--reset-limit", 1,
                 sys.executable, TRAIN, tmp_path, "--steps", 400, "--sleep", 0.05)
    wait_for_steps(tmp_path, 0, 6, proc)
    kill9(tmp_path, 0, 1)
    wait_for_steps(tmp_path, 1, 6, proc)
    kill9(tmp_path, 1, 0)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert generations(tmp_path) == [0, 1]
    assert re.search(r"elastic job failed: the job needed reset 2 \(rank 0 .*killed by signal 9.*"
                     r"\), more than --reset-limit 1", err), err[-3000:]


def test_too_few_slots_fails_after_elastic_timeout_naming_hosts_and_counts(run, tmp_path):
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:1\n")
    script.chmod(0o755)
    r = run("-np", 3, "--min-np", 2, "--host-discovery-script", script, "--elastic-timeout", 2,
            sys.executable, TRAIN, tmp_path, timeout=60)
    assert r.returncode == 1
    assert re.search(r"elastic job failed: timed out after --elastic-timeout 2 s waiting for 3 "
                     r"slots: localhost:1 available \(1 slots\) from --host-discovery-script ",
                     r.stderr), r.stderr
    assert 2 <= r.seconds < 30
    assert not generations(tmp_path)


def test_too_few_fixed_hosts_fail_at_once(run, tmp_path):
    r = run("-np", 3, "--min-np", 2, "-H", "localhost:2", sys.executable, TRAIN, tmp_path,
            timeout=60)
    assert r.returncode == 1
    assert "elastic job failed: need 3 slots, and no more can come: localhost:2 available " \
           "(2 slots) from the hosts" in r.stderr, r.stderr


def test_slots_added_by_discovery_join_at_the_next_commit(start, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    proc = start("-np", 2, "--min-np", 2, "--max-np", 3, "--host-discovery-script", script,
                 sys.executable, TRAIN, tmp_path, "--steps", 40, "--commit-every", 10,
                 "--check-every", 2, "--sleep", 0.1)
    wait_for_steps(tmp_path, 0, 5, proc)
    hosts.write_text("localhost:3\nlocalhost:1\n")  # a line twice: the last one counts
    hosts.write_text("localhost:3\n")
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-4000:]
    assert generations(tmp_path) == [0, 1], err[-3000:]
    assert "hosts changed: localhost:3 available" in err, err[-3000:]
    # Gone at a check_host_updates() (every 2 steps): the state of that step carried over.
    again = resumed(tmp_path, 1)
    assert sorted(again) == [0, 1, 2]
    (step, resets), = set(again.values())
    assert step % 2 == 0 and step > 5 and resets == 1, again
    check_final(tmp_path, 3, 40)


def test_an_error_of_the_training_code_ends_the_job(run, tmp_path):
    r = run("-np", 2, "--min-np", 1, "-H", "localhost:2", *COOLDOWN, sys.executable, TRAIN,
            tmp_path, "--raise-at", 7, timeout=120)
    assert r.returncode == 1
    assert generations(tmp_path) == [0]
    assert re.search(r"horolite-run: job failed: rank 1 \(host [^)]+\) failed: ValueError: bad batch "
                     r"at step 7 \(elastic_train.py:\d+\).* \(an error of the training code: an "
                     r"elastic job is not restarted for it\)", r.stderr), r.stderr[-3000:]


def test_an_uncaught_error_outside_the_elastic_function_ends_the_job_too(run, tmp_path):
    r = run("-np", 2, "--min-np", 1, "-H", "localhost:2", *COOLDOWN, sys.executable, TRAIN,
            tmp_path, "--raise-in-setup", timeout=120)
    assert r.returncode == 1
    assert generations(tmp_path) == [0]
    assert re.search(r"job failed: rank 0 \(host [^)]+\) failed: TypeError: bad setup argument "
                     r"\(elastic_train.py:\d+\).* \(an error of the training code", r.stderr), \
        r.stderr[-3000:]


def test_elastic_only_flags_need_an_elastic_job(run, tmp_path):
    r = run("-np", 2, "--reset-limit", 3, sys.executable, TRAIN, tmp_path)
    assert r.returncode == 2
    assert "--reset-limit applies to elastic jobs only: add --min-np N or " \
           "--host-discovery-script SCRIPT" in r.stderr
