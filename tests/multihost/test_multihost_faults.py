"""Faults of the network between simulated hosts (kill -9 and unreachable hosts are in
test_multihost_launcher.py)."""
import os
import re
import subprocess
import sys
import time

import pytest

from jobs import HOROLITE_RUN, ROOT

STEADY = os.path.join(ROOT, "tests", "multihost", "ranks", "steady_allreduce.py")


def _wait_for(path, job, seconds=60):
    deadline = time.monotonic() + seconds
    while not os.path.exists(path) and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert os.path.exists(path), "the job did not start reducing"


def test_a_link_down_for_5_seconds_is_survived_with_right_results(bed, no_leftovers, tmp_path):
    ready = str(tmp_path / "ready")
    job = bed.popen(0, [HOROLITE_RUN, "-H", "hl-a:1,hl-b:1,hl-c:1", "python", STEADY, "9", ready],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(ready, job)
        time.sleep(1)
        bed.link("hl-b", up=False)
        time.sleep(5)
        bed.link("hl-b", up=True)
        out, err = job.communicate(timeout=120)
    finally:
        bed.link("hl-b", up=True)
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == 0, out + err
    # Every step's result was checked against its known value, and the ranks did wait
    # for the link (a step of seconds), so the outage fell inside the job.
    longest = [float(m) for m in re.findall(r"steps checked, longest ([0-9.]+) s", out)]
    assert len(longest) == 3, out
    assert max(longest) >= 3.0, out


def test_a_host_whose_link_stays_down_ends_the_job_through_stall_detection(bed, no_leftovers,
                                                                           tmp_path):
    ready = str(tmp_path / "ready")
    job = bed.popen(0, [HOROLITE_RUN, "-H", "hl-a:1,hl-b:1,hl-c:1",
                        "--stall-check-warning-time-seconds", "2",
                        "--stall-check-shutdown-time-seconds", "5", "python", STEADY, "60", ready],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(ready, job)
        bed.link("hl-c", up=False)
        start = time.monotonic()
        out, err = job.communicate(timeout=60)
        elapsed = time.monotonic() - start
    finally:
        bed.link("hl-c", up=True)
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode != 0
    assert elapsed < 20, f"{elapsed:.0f}s: not ended by the stall shutdown"
    # Every rank's control message stalled; it cannot yet say which host stopped answering,
    # so the message names the stall and the setting that ended the job.
    assert "stalled inside a collective" in err and "STALL_SHUTDOWN_TIME_SECONDS=5" in err, err
    assert "job failed:" in err, err
