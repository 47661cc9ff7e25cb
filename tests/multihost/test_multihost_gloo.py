"""horolite-run --gloo across simulated hosts: no mpirun, remote ranks start over real ssh,
and the job's key reaches them on ssh's stdin, never on a command line of either host.
Then the faults of issue 59 in such a job: a remote rank killed or stopped, a host cut
off, a rank that never comes to the rendezvous, strangers on the job's ports."""
import json
import os
import re
import subprocess
import sys
import time

from jobs import HOROLITE_RUN, ROOT, launch, run_pytest_across, stopped_at_exit, wait_for_file

GLOO_PROBE = os.path.join(ROOT, "tests", "launcher_rank", "gloo_probe.py")


def test_gloo_over_ssh_2_hosts_x_2_ranks(bed, tmp_path):
    out = tmp_path / "marks"
    out.mkdir()
    r = launch(bed, "hl-a:2,hl-b:2", ["python", GLOO_PROBE, str(out)], timeout=120,
               env={"PROBE_PASSED": "from -x", "PROBE_GLOBAL": "not asked for",
                    "HOROLITE_MPIRUN": "/nonexistent/mpirun"},
               extra=["--gloo", "-x", "PROBE_PASSED", "--gloo-timeout-seconds", "20"])
    assert r.returncode == 0, r.stdout + r.stderr
    found = {int(name[5:]): json.loads((out / name).read_text()) for name in os.listdir(out)}
    assert sorted(found) == [0, 1, 2, 3]
    hosts = ["hl-a", "hl-a", "hl-b", "hl-b"]
    for rank, mark in found.items():
        env = mark["env"]
        assert mark["host"] == env["HOROLITE_HOSTNAME"] == hosts[rank]
        assert mark["peers"] == {str(q): hosts[q] for q in range(4)}
        assert (env["HOROLITE_RANK"], env["HOROLITE_SIZE"]) == (str(rank), "4")
        assert (env["HOROLITE_LOCAL_RANK"], env["HOROLITE_LOCAL_SIZE"]) == (str(rank % 2), "2")
        assert (env["HOROLITE_CROSS_RANK"], env["HOROLITE_CROSS_SIZE"]) == (str(rank // 2), "2")
        # hl-a's own address on its route to hl-b, for every rank (not 127.0.0.1)
        assert env["HOROLITE_RENDEZVOUS_ADDR"] == env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == \
            bed.host("hl-a").address
        assert mark["passed"]["PROBE_PASSED"] == "from -x"
        assert mark["passed"]["PROBE_GLOBAL"] == "not asked for"  # (as horovodrun --gloo)
        assert mark["cwd"] == os.getcwd()  # the launcher's directory, on hl-b too
        # Each rank looked at every command line on its own host (hl-a: horolite-run, the
        # ssh clients; hl-b: sshd's sessions and the wrappers) while the job ran.
        assert mark["key_on_cmdline"] == [], f"rank {rank}: the job key is on a command line"
        assert f"[{rank}]<stdout>:rank {rank} of 4 met 4\n" in r.stdout


def test_gloo_mismatches_across_hosts_name_the_tensor_and_the_ranks(bed):
    """The error matrix (tests/parallel/test_errors.py: shapes, dtypes, ops, names, and the
    runtime working on after each) on 2 hosts x 2 ranks started without MPI."""
    run_pytest_across(bed, "hl-a:2,hl-b:2", os.path.join(ROOT, "tests", "parallel",
                                                         "test_errors.py"), world="gloo",
                      env={"HOROLITE_MPIRUN": "/nonexistent/mpirun"})  # (--gloo needs none)


# ---- faults in a --gloo job of 2 hosts x 2 ranks, each rank reducing known inputs ----
# (the MPI-launched equivalents: test_multihost_remote_kill.py, test_multihost_faults.py)

LOOP = os.path.join(ROOT, "tests", "multihost", "ranks", "allreduce_loop.py")
STEADY = os.path.join(ROOT, "tests", "multihost", "ranks", "steady_allreduce.py")
FIXED = os.path.join(ROOT, "tests", "multihost", "ranks", "fixed_steps.py")
STRANGER = os.path.join(ROOT, "tests", "multihost", "stranger.py")
STALL_FLAGS = ("--stall-check-warning-time-seconds", "2",
               "--stall-check-shutdown-time-seconds", "5")


def _gloo(bed, command, *flags, env=None, **kw):
    """``horolite-run --gloo -H hl-a:2,hl-b:2 flags command``, started on hl-a (a Popen)."""
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    return bed.popen(0, [HOROLITE_RUN, "--gloo", "-H", "hl-a:2,hl-b:2", *flags, *command],
                     text=True, env=dict(os.environ, **(env or {})), **kw)


def _said(err, rank, pattern):
    """Whether one of rank's lines in the launcher's output matches `pattern`."""
    return any(line.startswith(f"[{rank}]<") and re.search(pattern, line)
               for line in err.splitlines())


def _job_processes(bed, name):
    """The job's processes left on a host: any but its sshd and ssh's sessions there (a
    session whose client's host is cut off waits for the cable like any TCP peer)."""
    left = []
    for pid in bed.host(name).pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if not f.read().startswith(b"sshd:"):
                    left.append(pid)
        except OSError:
            pass
    return left


def test_gloo_kill_9_of_a_remote_rank_is_named_by_every_survivor(bed, tmp_path):
    job = _gloo(bed, ["python", LOOP, str(tmp_path), "60"])
    with stopped_at_exit(job):
        wait_for_file(job, tmp_path / "3.pid")
        time.sleep(0.3)  # well inside the loop
        pid = (tmp_path / "3.pid").read_text()
        bed.on("hl-b", ["kill", "-9", pid])
        killed = time.monotonic()
        _, err = job.communicate(timeout=60)
        took = time.monotonic() - killed
    assert job.returncode == 128 + 9, err[-3000:]
    assert f"job failed: rank 3 (host hl-b, pid {pid}) was killed by signal 9 (SIGKILL); " \
           "ranks stopped as a result: 0, 1, 2" in err, err[-3000:]
    # Each survivor, on either host, names the rank whose connection closed.
    for r in (0, 1, 2):
        assert _said(err, r, re.escape("the connection to rank 3 (host hl-b) closed")), err[-5000:]
    assert took < 15, f"{took:.1f} s from the kill to the job's end"


def test_gloo_a_host_whose_link_goes_down_is_named_on_both_sides(bed, tmp_path):
    """hl-b's cable out: hl-a's ranks (and through them the launcher) name hl-b's ranks,
    and hl-b's ranks, whose output no longer reaches the launcher (its files do:
    --output-filename), name hl-a's and end on their own, all at the stall shutdown."""
    ready, logs = tmp_path / "ready", tmp_path / "logs"
    job = _gloo(bed, ["python", STEADY, "60", str(ready)], *STALL_FLAGS,
                "--output-filename", str(logs))
    with stopped_at_exit(job):
        try:
            wait_for_file(job, ready)
            bed.link("hl-b", up=False)
            down = time.monotonic()
            _, err = job.communicate(timeout=60)
            took = time.monotonic() - down
            deadline = time.monotonic() + 15
            while _job_processes(bed, "hl-b") and time.monotonic() < deadline:
                time.sleep(0.2)
            cut_off_left = _job_processes(bed, "hl-b")
        finally:
            bed.link("hl-b", up=True)
    assert job.returncode != 0
    assert took < 30, f"{took:.0f} s: not ended by the stall shutdown (the job runs 60 s)"
    for r in (0, 1):
        assert _said(err, r, r"no word from rank 2 \(host hl-b\), rank 3 \(host hl-b\) for \d+ s "
                             r"\(HOROLITE_STALL_SHUTDOWN_TIME_SECONDS=5\)"), err[-5000:]
    assert re.search(r"horolite-run: job failed: .*no word from rank 2 \(host hl-b\), rank 3 "
                     r"\(host hl-b\)", err), err[-3000:]
    # A peer's connection closing while a rank ends is expected, not a failure to report
    # (failure/channel.py's waits on horolite's own connections).
    assert "reporting the failure failed" not in err, err[-5000:]
    assert not cut_off_left, f"hl-b's ranks did not end on their own: {cut_off_left}"
    for r in (2, 3):
        text = (logs / f"rank.{r}" / "stderr").read_text()
        assert re.search(r"no word from rank 0 \(host hl-a\), rank 1 \(host hl-a\) for \d+ s",
                         text), text[-3000:]


def test_gloo_a_stopped_remote_rank_is_named_and_the_job_ends(bed, tmp_path):
    job = _gloo(bed, ["python", LOOP, str(tmp_path), "60"], *STALL_FLAGS)
    with stopped_at_exit(job):
        wait_for_file(job, tmp_path / "3.pid")
        pid = (tmp_path / "3.pid").read_text()
        try:
            bed.on("hl-b", ["kill", "-STOP", pid])
            stopped = time.monotonic()
            _, err = job.communicate(timeout=60)
            took = time.monotonic() - stopped
            # still stopped: only a SIGKILL ends it (a SIGTERM waits for a SIGCONT)
            deadline = time.monotonic() + 10
            while _job_processes(bed, "hl-b") and time.monotonic() < deadline:
                time.sleep(0.2)
            left = _job_processes(bed, "hl-b")
        finally:
            bed.on("hl-b", ["kill", "-CONT", pid], check=False)
    assert not left, f"left on hl-b while rank 3 was stopped: {left}"
    assert job.returncode != 0
    assert 4 < took < 20, f"{took:.1f} s from SIGSTOP to the job's end (stall shutdown: 5 s)"
    silent = (r"no word from rank 3 \(host hl-b\) for \d+ s "
              r"\(HOROLITE_STALL_SHUTDOWN_TIME_SECONDS=5\)")
    for r in (0, 1, 2):
        assert _said(err, r, silent), err[-5000:]
    assert re.search(r"horolite-run: job failed: .*no word from rank 3 \(host hl-b\)", err), \
        err[-3000:]


def test_gloo_a_rank_that_never_reaches_the_rendezvous_is_named_within_the_timeout(
        bed, tmp_path):
    """Rank 3 (on hl-b) sleeps before it starts Python: the others give up at init after
    --gloo-timeout-seconds, naming it."""
    late = f'[ "$HOROLITE_RANK" = 3 ] && sleep 60; exec python {LOOP} {tmp_path} 60'
    started = time.monotonic()
    job = _gloo(bed, ["sh", "-c", late], "--gloo-timeout-seconds", "5")
    with stopped_at_exit(job):
        _, err = job.communicate(timeout=60)
    took = time.monotonic() - started
    assert job.returncode != 0
    assert took < 20, f"{took:.1f} s (--gloo-timeout-seconds 5)"
    assert not list(tmp_path.glob("*.pid")), "a rank got past init"
    for r in (0, 1, 2):
        assert _said(err, r, r"after 5 s, .*lacks 1 of 4: rank 3 \(host hl-b\)"), err[-5000:]
    assert re.search(r"horolite-run: job failed: rank \d \(host hl-\w\) failed at init: "
                     r".*after 5 s, .*lacks 1 of 4: rank 3 \(host hl-b\); "
                     r"ranks stopped as a result: ", err), err[-3000:]


def test_gloo_strangers_on_the_rendezvous_and_data_ports_are_refused(bed, tmp_path):
    """From hl-c, while the job sets up and runs: silent connections, garbage and hellos
    under a wrong key, on the rendezvous port and every port the ranks may listen on
    (HOROLITE_TCP_PORT_RANGE). None gets in; the job completes with every result right."""
    ports, rv_port = "46100-46109", tmp_path / "rendezvous_port"
    stranger = bed.popen("hl-c", [sys.executable, STRANGER, "12", f"hl-a:{ports}", f"hl-b:{ports}",
                                  f"hl-a:@{rv_port}"], stdout=subprocess.PIPE, text=True)
    with stopped_at_exit(stranger):
        err_path = tmp_path / "launcher.err"
        with open(err_path, "w") as err_file:
            job = _gloo(bed, ["python", FIXED, "30"], "--verbose",
                        env={"HOROLITE_TCP_PORT_RANGE": ports}, stderr=err_file)
        with stopped_at_exit(job):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and job.poll() is None:
                found = re.search(r"--gloo: rendezvous on [0-9.]+:(\d+)", err_path.read_text())
                if found:
                    rv_port.write_text(found.group(1))
                    break
                time.sleep(0.02)
            out, _ = job.communicate(timeout=60)
        pestered = json.loads(stranger.communicate(timeout=60)[0])
    err = err_path.read_text()
    assert job.returncode == 0, err[-5000:]
    for r in range(4):
        assert f"[{r}]<stdout>:rank {r}: 30 steps\n" in out, out + err[-3000:]
    reached = pestered["reached"]
    rendezvous = f"hl-a:{rv_port.read_text()}"
    assert rendezvous in reached, pestered
    # Ranks' listeners on both hosts took strangers. (Each is open only during set-up, a
    # few tens of ms: on a busy machine a stranger may miss one of a host's two.)
    for host in ("hl-a", "hl-b"):
        assert [p for p in reached if p.startswith(host) and p != rendezvous], pestered
    assert pestered["wrong_key_accepted"] == [], pestered
