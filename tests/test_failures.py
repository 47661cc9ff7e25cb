"""Failures that explain themselves, under a real mpirun (and horolite-run).

Each job runs tests/failure_cases/scenario.py: every rank trains, the last rank
misbehaves. The checks: every other rank names the failing rank, its host and the
cause; the job ends; no process of the job is left in the process table.
"""
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from mpirun import ROOT, gloo_command, mpirun_command

SCENARIO = os.path.join(ROOT, "tests", "failure_cases", "scenario.py")
HOST = socket.gethostname()


def raise_line() -> int:
    with open(SCENARIO) as f:
        return next(i for i, line in enumerate(f, 1) if 'raise RuntimeError("bad batch")' in line)


def run_job(case, np_, outdir, env=None, launcher=False, timeout=90, world="mpi"):
    """world="gloo": started by horolite-run --gloo (no MPI)."""
    os.makedirs(outdir, exist_ok=True)
    child_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    if world == "gloo":
        cmd = gloo_command(np_)
    elif launcher:
        cmd = [sys.executable, "-m", "horolite.launcher", "-np", str(np_)]
    else:
        cmd = mpirun_command(np_)
    cmd += [sys.executable, SCENARIO, case, str(outdir)]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_env,
                          cwd=ROOT)
    proc.seconds = time.monotonic() - start
    proc.out = proc.stdout + proc.stderr
    left = leftover_processes(str(outdir))
    assert not left, f"processes of the job left behind: {left}\n{proc.out[-3000:]}"
    return proc


def leftover_processes(tag: str):
    time.sleep(0.3)
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if tag in cmdline and int(pid) != os.getpid():
            found.append((int(pid), cmdline))
    return found


def notes(outdir, rank):
    path = os.path.join(outdir, f"rank.{rank}")
    return open(path).read() if os.path.exists(path) else ""


def lines_of(out, rank, size):
    """The log lines of `rank`."""
    return [line for line in out.splitlines() if f"horolite rank {rank}/{size}]" in line]


def logged(out, rank, size, text):
    """Some log line of `rank` contains `text`."""
    return any(f"horolite rank {rank}/{size}]" in line and text in line
               for line in out.splitlines())


# lane: agreed allreduces on the exchange lane's thread (execution/lane.py), as across hosts.
LANE = {"HOROLITE_EXCHANGE_PIPELINE": "1"}


@pytest.mark.parametrize("np_,lane,world", [(2, False, "mpi"), (3, False, "mpi"),
                                            (4, False, "mpi"), (3, True, "mpi"),
                                            (2, False, "gloo"), (3, False, "gloo")])
def test_an_exception_on_one_rank_is_named_on_every_rank(np_, lane, world, tmp_path):
    # (gloo: started by horolite-run --gloo, whose summary names the rank too)
    proc = run_job("raise", np_, tmp_path, env=LANE if lane else None, world=world)
    bad = np_ - 1
    cause = (f"rank {bad} (host {HOST}) failed: RuntimeError: bad batch "
             f"(scenario.py:{raise_line()})")
    assert proc.returncode != 0
    for r in range(bad):
        assert logged(proc.out, r, np_, cause), proc.out[-3000:]
    assert "Traceback" in proc.out and "RuntimeError: bad batch" in proc.out
    # The job ended because of the failure, not by running out its 400 steps (the
    # run_job timeout is the bound on ending at all).
    assert not any("finished" in notes(tmp_path, r) for r in range(np_)), proc.out[-3000:]
    if world == "gloo":
        summary = [line for line in proc.stderr.splitlines()
                   if line.startswith("horolite-run: job")]
        assert len(summary) == 1 and f"rank {bad} (host {HOST}" in summary[0], proc.stderr[-3000:]


@pytest.mark.parametrize("case,code", [("exit3", 3), ("exit0", 0)])
def test_a_rank_leaving_early_is_named_with_its_exit_code(case, code, tmp_path):
    np_ = 3
    proc = run_job(case, np_, tmp_path)
    for r in range(np_ - 1):
        text = notes(tmp_path, r)
        assert (f"ShutdownError: tensor 'grad': rank {np_ - 1} (host {HOST}) left the job "
                f"(its process exited with code {code})") in text, proc.out[-3000:]
    assert proc.returncode != 0


def test_sigterm_is_named_on_every_rank(tmp_path):
    proc = run_job("sigterm", 3, tmp_path)
    for r in range(2):
        assert logged(proc.out, r, 3, f"rank 2 (host {HOST}) was killed by signal 15 (SIGTERM)"), \
            proc.out[-3000:]


def test_stall_shutdown_ends_the_job_at_its_time(tmp_path):
    # One rank asleep in user code; every rank must exit, none stays in MPI_Finalize.
    np_ = 3
    proc = run_job("sleep", np_, tmp_path, env={"HOROLITE_STALL_SHUTDOWN_TIME_SECONDS": "3"})
    assert proc.returncode != 0
    # (the time waited is what the machine took: at least the setting, never a fixed text)
    message = re.compile(r"stall shutdown after HOROLITE_STALL_SHUTDOWN_TIME_SECONDS=3: "
                         r"tensor 'grad' waited (\d+\.\d) s: submitted by ranks 0, 1, "
                         rf"missing on rank 2 \(host {re.escape(HOST)}\)")
    for r in range(np_):
        waited = [float(m.group(1)) for m in map(message.search, lines_of(proc.out, r, np_)) if m]
        assert waited and min(waited) >= 3.0, proc.out[-3000:]
    assert "asleep" in notes(tmp_path, 2)
    assert proc.seconds < 100  # the stall shutdown ended it: the sleeper alone takes 120 s


@pytest.mark.parametrize("case,np_,shared_memory,lane", [("sigstop-inside", 2, "1", False),
                                                        ("sigstop-inside", 3, "1", False),
                                                        ("sigstop-inside", 3, "0", False),
                                                        ("sigstop-inside", 3, "0", True),
                                                        ("sigstop", 3, "0", False),
                                                        ("sigstop", 3, "0", True),
                                                        ("sigstop", 3, "1", False)])
def test_a_frozen_rank_is_named_on_every_rank_and_ends_the_job(case, np_, shared_memory, lane,
                                                               tmp_path):
    # sigstop-inside: frozen inside the data phase of a 32 MB allreduce (its peers wait for
    # its data); sigstop: frozen with a tensor its peers never submit (they wait in the
    # control message). Either way the peers name the rank they no longer hear from, not
    # the neighbour that waits for it too; what they were waiting in says which case it was.
    # With shared memory the control message is a round of the board (control_board.py),
    # whose futex waits come back to hear heartbeats and to time the stall.
    # (lane: the data phase waits on the lane's thread, the control message on the
    # background thread, each timed by its own watch)
    proc = run_job(case, np_, tmp_path, timeout=180, env={
        "HOROLITE_SHARED_MEMORY": shared_memory, "HOROLITE_STALL_CHECK_TIME_SECONDS": "1",
        "HOROLITE_STALL_SHUTDOWN_TIME_SECONDS": "3", **(LANE if lane else {})})
    if case == "sigstop-inside":
        assert "stopping in the data phase of tensor 'big'" in notes(tmp_path, np_ - 1)
        waiting_in = "tensor 'big'"
    else:
        assert "stopping" in notes(tmp_path, np_ - 1)
        waiting_in = "this cycle's control message"
    assert proc.returncode != 0
    # (times as the machine measured them: at least the settings, never fixed texts)
    warned = re.compile(rf"{re.escape(waiting_in)} has waited (\d+) s inside a collective")
    stalled = re.compile(rf"{re.escape(waiting_in)} stalled inside a collective for (\d+) s")
    silent = re.compile(rf"no word from rank {np_ - 1} \(host {re.escape(HOST)}\) for (\d+) s "
                        r"\(HOROLITE_STALL_SHUTDOWN_TIME_SECONDS=3\); shutting the job down")
    for r in range(np_ - 1):
        lines = lines_of(proc.out, r, np_)
        for pattern, at_least in ((warned, 1), (stalled, 3), (silent, 3)):
            seen = [int(m.group(1)) for m in map(pattern.search, lines) if m]
            assert seen and min(seen) >= at_least, (pattern.pattern, proc.out[-3000:])
        assert silent.search(notes(tmp_path, r)), proc.out[-3000:]


def test_horolite_run_names_the_failing_rank_first(tmp_path):
    # MPICH names its segment from the job's identity, so a file another killed job left
    # can have the same name; the launcher rightly leaves files older than the job alone.
    before = set(os.listdir("/dev/shm"))
    proc = run_job("raise", 3, tmp_path, launcher=True)
    summary = [line for line in proc.stderr.splitlines() if line.startswith("horolite-run: job")]
    assert summary == [f"horolite-run: job failed: rank 2 (host {HOST}) failed: RuntimeError: "
                       f"bad batch (scenario.py:{raise_line()}); ranks stopped as a result: "
                       "0, 1"], proc.stderr[-3000:]
    assert proc.returncode == 1
    # Nothing the ranks had mapped from /dev/shm is left (the launcher removes it).
    mapped = set()
    for r in range(3):
        with open(tmp_path / f"shm.{r}") as f:
            mapped |= set(f.read().split())
    assert mapped, "the ranks mapped nothing from /dev/shm: nothing was checked"
    mapped = {p for p in mapped if os.path.basename(p) not in before}
    assert mapped, "the ranks mapped only files that existed before the job: nothing checked"
    assert not [p for p in mapped if os.path.exists(p)], proc.stderr[-2000:]


@pytest.mark.parametrize("case", ["raise", "exit3", "sigterm"])
def test_under_plain_mpirun_the_failed_jobs_shared_memory_is_removed_by_its_ranks(case, tmp_path):
    # No horolite-run to clean up: a rank that ends because the job cannot go on unlinks
    # what it maps (the host's MPICH segment, horolite's window) on its way out.
    before = set(os.listdir("/dev/shm"))
    proc = run_job(case, 3, tmp_path)
    assert proc.returncode != 0
    mapped = set()
    for r in range(3):
        with open(tmp_path / f"shm.{r}") as f:
            mapped |= set(f.read().split())
    mapped = {p for p in mapped if os.path.basename(p) not in before}
    assert mapped, "the ranks mapped only files that existed before the job: nothing checked"
    assert not [p for p in mapped if os.path.exists(p)], proc.out[-2000:]


def test_horolite_run_names_a_rank_that_left_early(tmp_path):
    proc = run_job("exit0", 2, tmp_path, launcher=True)
    summary = [line for line in proc.stderr.splitlines() if line.startswith("horolite-run: job")]
    assert len(summary) == 1 and re.match(
        rf"horolite-run: job failed: rank 1 \(host {HOST}, pid \d+\) exited with code 0 while "
        r"other ranks still ran collectives; ranks stopped as a result: 0$", summary[0]), \
        proc.stderr[-3000:]
    assert proc.returncode == 1


def test_forked_children_never_touch_mpi(tmp_path):
    np_ = 2
    cmd = mpirun_command(np_) + [sys.executable,
                                 os.path.join(ROOT, "tests", "failure_cases", "forks.py"),
                                 str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "PMI" not in out and "Broken pipe" not in out, out[-3000:]
    assert all(notes(tmp_path, r) == "ok\n" for r in range(np_)), out[-3000:]
    assert not leftover_processes(str(tmp_path))


def test_in_tensorflow_the_error_keeps_the_cause(tmp_path):
    pytest.importorskip("tensorflow")
    cmd = mpirun_command(2) + [sys.executable,
                               os.path.join(ROOT, "tests", "failure_cases", "tf_cause.py"),
                               str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    seen = notes(tmp_path, 0)
    # Inside tf.function TensorFlow picks the class (UnknownError here); the text stays.
    assert seen.startswith("UnknownError") and (
        f"rank 1 (host {HOST}) failed: RuntimeError: bad batch (tf_cause.py:") in seen, out[-3000:]
    assert not leftover_processes(str(tmp_path))
