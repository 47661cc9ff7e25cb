"""Elastic jobs across simulated hosts: a host's ranks killed, hosts added and removed by the
discovery script. horolite-run runs on hl-a; every result is checked against NumPy."""
import os
import re
import sys
import time

from jobs import HOROLITE_RUN, ROOT, stopped_at_exit

sys.path.insert(0, os.path.join(ROOT, "tests", "launcher"))
from elastic_util import TRAIN, check_final, generations, resumed, steps_done  # noqa: E402


def _start(bed, args):
    import subprocess
    return bed.popen(0, [HOROLITE_RUN, *map(str, args)], stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True)


def _wait(outdir, gen, count, job, seconds=120):
    deadline = time.monotonic() + seconds
    while steps_done(outdir, gen) < count:
        assert job.poll() is None, job.stderr.read()[-4000:]
        assert time.monotonic() < deadline, f"generation {gen} did not reach step {count}"
        time.sleep(0.05)


def _pid(outdir, gen, rank):
    with open(os.path.join(outdir, f"pid.{gen}.{rank}")) as f:
        return f.read().strip()  # in its host's PID namespace


def test_kill9_of_one_hosts_ranks_goes_on_with_the_survivors(bed, tmp_path):
    job = _start(bed, ["-H", "hl-a:1,hl-b:2,hl-c:1", "-np", 4, "--min-np", 2, sys.executable,
                       TRAIN, tmp_path, "--steps", 36, "--commit-every", 4, "--sleep", 0.1])
    with stopped_at_exit(job):
        _wait(tmp_path, 0, 10, job)
        bed.on("hl-b", ["kill", "-9", _pid(tmp_path, 0, 1), _pid(tmp_path, 0, 2)])
        out, err = job.communicate(timeout=240)
    assert job.returncode == 0, err[-4000:]
    assert generations(tmp_path) == [0, 1], err[-3000:]
    assert re.search(r"generation 0 failed \(rank [12] \(host hl-b, pid \d+\) was killed by "
                     r"signal 9 \(SIGKILL\).*\); blacklisted hl-b\n", err), err[-3000:]
    assert "generation 1: 2 ranks on hl-a:1,hl-c:1" in err, err[-3000:]
    (step, resets), = set(resumed(tmp_path, 1).values())
    assert step in (8, 12) and resets == 1
    check_final(tmp_path, 2, 36)
    assert not [p for p in os.listdir("/dev/shm") if p.startswith("horolite-elastic-")]


def test_hosts_added_and_removed_by_discovery_join_and_leave_at_a_commit(bed,
                                                                           tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("hl-a:1\nhl-b:1\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    job = _start(bed, ["-np", 2, "--min-np", 2, "--host-discovery-script", script,
                       sys.executable, TRAIN, tmp_path, "--steps", 60, "--commit-every", 3,
                       "--sleep", 0.1])
    with stopped_at_exit(job):
        _wait(tmp_path, 0, 4, job)
        hosts.write_text("hl-a:1\nhl-b:1\nhl-c:2\n")
        _wait(tmp_path, 1, 4, job)
        hosts.write_text("hl-a:1\nhl-c:2\n")
        out, err = job.communicate(timeout=240)
    assert job.returncode == 0, err[-4000:]
    assert generations(tmp_path) == [0, 1, 2], err[-3000:]
    assert "generation 1: 4 ranks on hl-a:1,hl-b:1,hl-c:2" in err, err[-3000:]
    assert "generation 2: 3 ranks on hl-a:1,hl-c:2" in err, err[-3000:]
    for gen, size in ((1, 4), (2, 3)):
        found = resumed(tmp_path, gen)
        assert sorted(found) == list(range(size))
        (step, resets), = set(found.values())
        assert step % 3 == 0 and resets == 1, found
    check_final(tmp_path, 3, 60)
