"""horolite-run across simulated hosts: environment, output, failures, signals, unreachable hosts.

Jobs start on hl-a; ranks on hl-b and hl-c start through their sshd, whose
login environment is not the launcher's: what they see is what the launcher
passed.
"""
import os
import re
import signal
import sys
import time

import pytest

import needed_tools
from jobs import ROOT, launch, stopped_at_exit

sys.path.insert(0, os.path.join(ROOT, "tests", "launcher"))
from launcher_util import PROBE, marks, wait_for_marks  # noqa: E402

THREE = "hl-a:1,hl-b:1,hl-c:1"
HOSTS = ["hl-a", "hl-b", "hl-c"]


def test_every_rank_on_every_host_has_the_launchers_environment(bed, tmp_path):
    pythonpath = tmp_path / "pythonpath"
    pythonpath.mkdir()
    env = {"PROBE_PASSED": "from -x", "PROBE_GLOBAL": "not asked for",
           "HOROLITE_CYCLE_TIME": "2", "HOROVOD_CACHE_CAPACITY": "64",
           "PYTHONPATH": str(pythonpath), "LD_LIBRARY_PATH": str(tmp_path)}
    out = tmp_path / "marks"
    out.mkdir()
    # -x with and without a value: once made MPICH pass only the listed variables to other hosts.
    r = launch(bed, THREE, ["python", PROBE, str(out), "--print", "1"], env=env,
               extra=["-x", "PROBE_PASSED", "-x", "PROBE_SET=a b"])
    assert r.returncode == 0, r.stdout + r.stderr
    found = marks(out)
    assert sorted(found) == [0, 1, 2]
    want_paths = {k: dict(os.environ, **env).get(k)
                  for k in ("PATH", "VIRTUAL_ENV", "PYTHONPATH", "LD_LIBRARY_PATH")}
    for rank, mark in found.items():
        assert mark["host"] == HOSTS[rank]
        assert mark["allreduce"] == 3
        for name, want in want_paths.items():
            got = mark["paths"][name]
            if name in ("PATH", "LD_LIBRARY_PATH") and want and got:
                # Open MPI puts its own directory in front: the launcher's must follow.
                assert got.endswith(want), f"rank {rank} on {mark['host']}: {name}={got}"
            else:
                assert got == want, f"rank {rank} on {mark['host']}: {name}={got}"
        assert mark["executable"] == os.path.join(os.path.dirname(sys.executable), "python")
        assert {k: mark["env"].get(k) for k in ("PROBE_PASSED", "PROBE_SET", "HOROLITE_CYCLE_TIME",
                                                "HOROVOD_CACHE_CAPACITY")} == {
            "PROBE_PASSED": "from -x", "PROBE_SET": "a b", "HOROLITE_CYCLE_TIME": "2",
            "HOROVOD_CACHE_CAPACITY": "64"}
        # Output of remote ranks comes back line by line with its rank prefix.
        assert f"[{rank}]<stdout>:out line 0 of rank {rank}\n" in r.stdout
        assert f"[{rank}]<stderr>:err line 0 of rank {rank}\n" in r.stderr


def test_kill_9_of_a_remote_rank_ends_the_job_naming_rank_host_and_pid(bed, tmp_path):
    r = launch(bed, THREE, ["python", PROBE, str(tmp_path), "--fail-rank", "1", "--fail-how", "kill",
                            "--sleep", "120"], timeout=120)
    ended = time.time()
    killed = marks(tmp_path)[1]
    # The rank kills itself 0.3 s after writing its mark.
    after_kill = ended - os.path.getmtime(tmp_path / "1.json") - 0.3
    assert r.returncode == 128 + signal.SIGKILL, r.stderr
    # The pid of the process that died (as hl-b numbers it), not its wrapper's.
    assert f"rank 1 (host hl-b, pid {killed['pid']}) was killed by signal 9 (SIGKILL)" in r.stderr
    assert after_kill < 60, f"the job ended {after_kill:.1f}s after the kill (the ranks sleep 120 s)"
    assert "HYDU_sock_write" not in r.stderr + r.stdout


def test_ctrl_c_stops_every_rank_on_every_host(bed, tmp_path):
    job = bed.popen(0, [os.path.join(os.path.dirname(sys.executable), "horolite-run"), "-H", THREE,
                        "python", PROBE, str(tmp_path), "--sleep", "120"],
                    stdout=__import__("subprocess").PIPE, stderr=__import__("subprocess").PIPE,
                    text=True)
    with stopped_at_exit(job):
        assert wait_for_marks(tmp_path, 3, 60)
        with open(f"/proc/{job.pid}/task/{job.pid}/children") as f:
            launcher = int(f.read().split()[0])  # nsenter's child: horolite-run on hl-a
        os.kill(launcher, signal.SIGINT)
        out, err = job.communicate(timeout=30)
    assert job.returncode == 130, err
    assert "stopped by SIGINT" in err


def test_unreachable_host_fails_at_start(bed, tmp_path):
    with open(os.path.join(bed.dir, "hosts"), "a") as f:
        f.write("198.18.0.99 hl-gone\n")  # an address no host has
    r = launch(bed, "hl-a:1,hl-gone:1", ["python", PROBE, str(tmp_path)], timeout=60)
    assert r.returncode == 2
    assert re.search(r"cannot reach 1 of 1 remote host\(s\) with ssh \(hl-gone: ssh: connect to "
                     r"host hl-gone port 22: (No route to host|Connection timed out)", r.stderr), r.stderr
    assert not marks(tmp_path)  # nothing started


def test_host_that_refuses_ssh_fails_at_start(bed, tmp_path):
    if needed_tools.missing("iptables"):  # the host refuses ssh by a firewall rule
        pytest.skip(needed_tools.missing("iptables"))
    bed.on("hl-c", ["iptables", "-I", "INPUT", "-p", "tcp", "--dport", "22", "-j", "REJECT",
                    "--reject-with", "tcp-reset"])
    try:
        r = launch(bed, THREE, ["python", PROBE, str(tmp_path)], timeout=60)
    finally:
        bed.on("hl-c", ["iptables", "-D", "INPUT", "-p", "tcp", "--dport", "22", "-j", "REJECT",
                        "--reject-with", "tcp-reset"])
    assert r.returncode == 2
    assert "cannot reach 1 of 2 remote host(s) with ssh (hl-c: ssh: connect to host hl-c port 22: " \
           "Connection refused)" in r.stderr, r.stderr
    assert not marks(tmp_path)
