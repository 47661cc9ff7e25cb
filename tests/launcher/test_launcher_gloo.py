"""horolite-run --gloo end to end on this host: no mpirun, ranks meet at the launcher's
rendezvous (the rank script alone, not horolite.init); failures end the job as over mpirun,
and the job's key is on no command line."""
import json
import os
import signal
import sys

import pytest

from launcher_util import REPO, wait_for_marks, wait_until_gone

GLOO_PROBE = os.path.join(REPO, "tests", "launcher_rank", "gloo_probe.py")
NO_MPI = {"HOROLITE_MPIRUN": "/nonexistent/mpirun"}  # --gloo must not look for one


def gloo_marks(outdir):
    """rank -> the mark file (rank.<r>) each rank of a gloo_probe run wrote."""
    found = {}
    for name in os.listdir(outdir):
        if name.startswith("rank.") and name[5:].isdigit():
            with open(os.path.join(outdir, name)) as f:
                found[int(name[5:])] = json.load(f)
    return found


def assert_no_processes(token, seconds=5.0):
    left = wait_until_gone(token, seconds)
    assert not left, "processes left behind:\n" + "\n".join(left)


@pytest.mark.parametrize("np_", [1, 2, 3, 4])
def test_ranks_meet_at_the_rendezvous_with_their_environment(run, tmp_path, np_):
    r = run("--gloo", "-np", np_, "--gloo-timeout-seconds", "20", "-x", "PROBE_PASSED",
            "-x", "PROBE_SET=a b", "--cycle-time-ms", "2", sys.executable, GLOO_PROBE, tmp_path,
            env=dict(NO_MPI, PROBE_PASSED="yes", PROBE_GLOBAL="not asked for"))
    assert r.returncode == 0, r.stderr
    found = gloo_marks(tmp_path)
    assert set(found) == set(range(np_))
    port = found[0]["env"]["HOROLITE_RENDEZVOUS_PORT"]
    keys = {mark["env"]["HOROLITE_JOB_KEY"] for mark in found.values()}
    assert len(keys) == 1 and len(keys.pop()) == 64  # one 32-byte key, as hex
    for rank, mark in found.items():
        env = mark["env"]
        assert mark["peers"] == {str(q): mark["host"] for q in range(np_)}
        want = {"RANK": rank, "SIZE": np_, "LOCAL_RANK": rank, "LOCAL_SIZE": np_,
                "CROSS_RANK": 0, "CROSS_SIZE": 1, "HOSTNAME": "localhost"}
        for name, value in want.items():
            assert env["HOROLITE_" + name] == env["HOROVOD_" + name] == str(value), name
        assert env["HOROLITE_RENDEZVOUS_ADDR"] == env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "127.0.0.1"
        assert env["HOROLITE_RENDEZVOUS_PORT"] == env["HOROVOD_GLOO_RENDEZVOUS_PORT"] == port
        assert env["HOROLITE_GLOO_TIMEOUT_SECONDS"] == "20"
        assert (env["HOROVOD_CONTROLLER"], env["HOROVOD_CPU_OPERATIONS"]) == ("gloo", "gloo")
        assert env["HOROLITE_CYCLE_TIME"] == "2"  # the setting flags as over mpirun
        assert mark["passed"] == {"PROBE_PASSED": "yes", "PROBE_SET": "a b",
                                  "PROBE_GLOBAL": "not asked for"}
        assert mark["key_on_cmdline"] == [], "the job key is on a command line"
        assert f"[{rank}]<stdout>:rank {rank} of {np_} met {np_}\n" in r.stdout
    assert "##horolite-run##" not in r.stderr + r.stdout
    assert_no_processes(str(tmp_path))


def test_a_rank_that_exits_3_ends_the_job_with_code_3(run, tmp_path):
    r = run("--gloo", "-np", "3", sys.executable, GLOO_PROBE, tmp_path, "--fail-rank", "1",
            "--fail-code", "3", "--sleep", "60", env=NO_MPI)
    assert r.returncode == 3, r.stderr
    assert "job failed: rank 1 (host" in r.stderr and "exited with code 3" in r.stderr
    assert "ranks stopped as a result: 0, 2" in r.stderr
    assert r.seconds < 30  # ended by the failure: the others would sleep 60 s
    assert_no_processes(str(tmp_path))


def test_a_rank_killed_with_sigkill_ends_the_others(run, tmp_path):
    r = run("--gloo", "-np", "3", sys.executable, GLOO_PROBE, tmp_path, "--fail-rank", "2",
            "--fail-how", "kill", "--sleep", "60", env=NO_MPI)
    assert r.returncode == 128 + signal.SIGKILL, r.stderr
    pid = gloo_marks(tmp_path)[2]["pid"]
    assert "rank 2 (host " in r.stderr and f"pid {pid}) was killed by signal 9 (SIGKILL)" \
        in r.stderr, r.stderr
    assert r.seconds < 30
    assert_no_processes(str(tmp_path))


def test_ctrl_c_stops_every_rank(start, tmp_path):
    proc = start("--gloo", "-np", "2", sys.executable, GLOO_PROBE, tmp_path, "--sleep", "60",
                 env=NO_MPI)
    assert wait_for_marks(tmp_path, 2, 30, read=gloo_marks), \
        proc.stderr.read() if proc.poll() is not None else "no marks"
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=30)
    assert proc.returncode == 130 and "stopped by SIGINT" in proc.stderr.read()
    assert_no_processes(str(tmp_path))


def test_without_mpi_the_error_names_both_ways_out(run):
    r = run("-np", "2", "true", env=NO_MPI)
    assert r.returncode == 2
    assert 'pip install "horolite[mpich]"' in r.stderr and "--gloo" in r.stderr, r.stderr
