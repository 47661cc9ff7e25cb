"""Faults between simulated hosts: a link down for a while or for good, an exception on
another host (kill -9 and unreachable hosts are in test_multihost_launcher.py)."""
import os
import re
import subprocess
import time

import pytest

from jobs import HOROLITE_RUN, ROOT, stopped_at_exit

STEADY = os.path.join(ROOT, "tests", "multihost", "ranks", "steady_allreduce.py")
PROBE = os.path.join(ROOT, "tests", "launcher_rank", "probe.py")


def _wait_for(path, job, seconds=60):
    deadline = time.monotonic() + seconds
    while not os.path.exists(path) and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert os.path.exists(path), "the job did not start reducing"


def _through_outage(bed, job, ready, host, seconds, timeout):
    """(out, err) of `job` once it has started reducing and `host`'s link has been down
    for `seconds`, then up again."""
    with stopped_at_exit(job):
        try:
            _wait_for(ready, job)
            time.sleep(1)
            bed.link(host, up=False)
            time.sleep(seconds)
            bed.link(host, up=True)
            return job.communicate(timeout=timeout)
        finally:
            bed.link(host, up=True)


def test_a_link_down_for_5_seconds_is_survived_with_right_results(bed, tmp_path):
    ready = str(tmp_path / "ready")
    job = bed.popen(0, [HOROLITE_RUN, "-H", "hl-a:1,hl-b:1,hl-c:1", "python", STEADY, "9", ready],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = _through_outage(bed, job, ready, "hl-b", 5, timeout=120)
    assert job.returncode == 0, out + err
    # Every step's result was checked against its known value, and the ranks did wait
    # for the link (a step of seconds), so the outage fell inside the job.
    longest = [float(m) for m in re.findall(r"steps checked, longest ([0-9.]+) s", out)]
    assert len(longest) == 3, out
    assert max(longest) >= 3.0, out


OUTAGE = float(os.environ.get("HOROLITE_TEST_OUTAGE_SECONDS", "20"))


def test_after_an_outage_the_job_ends_quietly_and_together(bed, tmp_path):
    """A link down past the stall warning: the beats each rank sent meanwhile arrive late,
    all at once. They are taken in at shutdown (heartbeat.py), so the MPI library has no
    unmatched message to complain about, and both ranks shut down within a moment."""
    ready = str(tmp_path / "ready")
    job = bed.popen(0, [HOROLITE_RUN, "-H", "hl-a:1,hl-b:1", "--stall-check-warning-time-seconds",
                        "3", "python", STEADY, "8", ready],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = _through_outage(bed, job, ready, "hl-b", OUTAGE, timeout=180)
    assert job.returncode == 0, out + err
    assert "no word from rank 1 (host hl-b)" in err  # the outage was seen
    assert "was not matched" not in out + err, (out + err)[-3000:]
    ends = [float(t) for t in re.findall(r"rank \d: shut down at ([0-9.]+)", out)]
    assert len(ends) == 2, out
    assert abs(ends[0] - ends[1]) < 3.0, out


@pytest.mark.parametrize("hosts,env", [
    ("hl-a:1,hl-b:1,hl-c:2", {}),
    ("hl-a:2,hl-c:2", {"HOROLITE_HIERARCHICAL_ALLREDUCE": "1"})], ids=["ring", "hierarchical"])
def test_a_host_whose_link_stays_down_is_named_by_the_other_hosts_ranks(hosts, env, bed,
                                                                        tmp_path):
    ready = str(tmp_path / "ready")
    job = bed.popen(0, [HOROLITE_RUN, "-H", hosts,
                        "--stall-check-warning-time-seconds", "2",
                        "--stall-check-shutdown-time-seconds", "5", "python", STEADY, "60", ready],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                    env=dict(os.environ, **env))
    with stopped_at_exit(job):
        try:
            _wait_for(ready, job)
            bed.link("hl-c", up=False)
            start = time.monotonic()
            out, err = job.communicate(timeout=60)
            elapsed = time.monotonic() - start
        finally:
            bed.link("hl-c", up=True)
    assert job.returncode != 0
    assert elapsed < 50, f"{elapsed:.0f}s: not ended by the stall shutdown (the job runs 60 s)"
    # Every rank on the hosts still connected names hl-c's ranks (from their heartbeats),
    # whichever rank it was waiting for itself.
    silent = re.compile(r"no word from rank 2 \(host hl-c\), rank 3 \(host hl-c\) for \d+ s "
                        r"\(HOROLITE_STALL_SHUTDOWN_TIME_SECONDS=5\)")
    for r in (0, 1):
        assert any(line.startswith(f"[{r}]") and silent.search(line)
                   for line in err.splitlines()), err
    assert re.search(r"horolite-run: job failed: .*no word from rank 2 \(host hl-c\)", err), err


def test_an_exception_on_another_host_is_named_on_every_rank(bed, tmp_path):
    job = bed.run([HOROLITE_RUN, "-H", "hl-a:1,hl-b:2", "python", PROBE, str(tmp_path),
                   "--fail-rank", "2", "--fail-how", "raise", "--train", "30"], timeout=120)
    line = next(i for i, text in enumerate(open(PROBE), 1) if "probe failure on rank" in text)
    cause = f"rank 2 (host hl-b) failed: RuntimeError: probe failure on rank 2 (probe.py:{line})"
    for r in (0, 1):
        assert any(text.startswith(f"[{r}]") and cause in text
                   for text in job.stderr.splitlines()), job.stderr[-3000:]
    assert f"horolite-run: job failed: {cause}; ranks stopped as a result: 0, 1" in job.stderr, \
        job.stderr[-3000:]
    assert job.returncode == 1


def test_a_firewall_that_drops_horolites_connections_is_named_at_init(bed):
    """hl-b drops every packet to the ports horolite's own connections may use
    (HOROLITE_TCP_PORT_RANGE): init fails within the set-up timeout on both ranks, naming
    both hosts and the address tried, instead of hanging."""
    rule = ["INPUT", "-p", "tcp", "--dport", "45000:45009", "-j", "DROP"]
    env = dict(os.environ, HOROLITE_CROSS_HOST_TRANSPORT="tcp", HOROLITE_TCP_PORT_RANGE="45000-45009",
               HOROLITE_TCP_TIMEOUT_SECONDS="3")
    bed.on("hl-b", ["iptables", "-A", *rule])
    try:
        started = time.monotonic()
        job = bed.run([HOROLITE_RUN, "-H", "hl-a:1,hl-b:1", "python", "-c",
                       "import horolite as hvd; hvd.init()"], timeout=120, env=env)
        took = time.monotonic() - started
    finally:
        bed.on("hl-b", ["iptables", "-D", *rule])
    assert job.returncode != 0
    said = re.search(r"rank 0 \(host hl-a\) could not connect to rank 1 \(host hl-b\) at "
                     r"198\.18\.0\.12:4500\d: no answer within 3 s \(HOROLITE_TCP_TIMEOUT_SECONDS\): "
                     r"a firewall dropping it",
                     job.stderr)
    assert said, job.stderr[-3000:]
    assert "rank 1 (host hl-b) heard nothing within 3 s" in job.stderr, job.stderr[-3000:]
    assert took < 60, took
