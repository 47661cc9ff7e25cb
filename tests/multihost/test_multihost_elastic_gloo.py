"""Elastic training without MPI across simulated hosts (hl-a:2, hl-b:2, real sshd): the
survivors of a failure go on in their running processes, and a new worker started over
ssh joins at a commit (launcher/elastic_gloo.py, horolite/elastic/in_process.py).
Every run is checked against NumPy (tests/launcher_rank/elastic_train.py's reference)."""
import os
import re
import subprocess
import sys
import time

from jobs import HOROLITE_RUN, ROOT, stopped_at_exit
from test_multihost_gloo import _job_processes

sys.path.insert(0, os.path.join(ROOT, "tests", "launcher"))
from test_launcher_elastic_gloo import (check_finals, first_step_after, full_world,  # noqa: E402
                                        lines, pid, stepping, until)

IN_PROCESS = os.path.join(ROOT, "tests", "launcher_rank", "elastic_in_process.py")
HOST_OF = {"w0": "hl-a", "w1": "hl-a", "w2": "hl-b", "w3": "hl-b"}


def _job(bed, tmp_path, *flags, env=None):
    return bed.popen(0, [HOROLITE_RUN, "--gloo", "-H", "hl-a:2,hl-b:2", "-np", "4",
                         "--min-np", "2", *flags, "python", IN_PROCESS, str(tmp_path),
                         "--steps", "100000", "--commit-every", "3", "--sleep", "0.02",
                         "--until-file", str(tmp_path / "stop")],
                     text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                     env=dict(os.environ, HOROLITE_MPIRUN="/nonexistent/mpirun", **(env or {})))


def _finish(job, tmp_path):
    (tmp_path / "stop").write_text("")
    _, err = job.communicate(timeout=120)
    return err


def test_kill_9_of_a_remote_rank_ten_times_the_others_go_on_and_a_new_worker_joins_over_ssh(
        bed, tmp_path):
    job, took, victim = _job(bed, tmp_path), [], "w3"
    with stopped_at_exit(job):
        until(lambda: full_world(tmp_path, 4), job, "generation 0", 120)
        for k in range(10):
            newcomer, before = f"w{4 + k}", max(g for g, _, _ in stepping(tmp_path).values())
            killed_at = time.time()
            bed.on("hl-b", ["kill", "-9", str(pid(tmp_path, victim))])
            until(lambda: newcomer in stepping(tmp_path) and full_world(tmp_path, 4), job,
                  f"{newcomer}'s join", 120)
            took.append(first_step_after(tmp_path, before) - killed_at)
            victim = newcomer  # (the newest worker is rank 3, on hl-b)
        err = _finish(job, tmp_path)
    assert len(re.findall(r"generation \d+: rank 3 \(w\d+, host hl-b\) was killed by signal 9 "
                          r"\(SIGKILL\); generation \d+: 3 rank\(s\) go on", err)) == 10, \
        err[-3000:]
    for k in range(10):
        assert f"w{4 + k} starts on hl-b" in err and f"w{4 + k} (host hl-b) joins" in err, \
            (k, err[-3000:])
    done = check_finals(tmp_path, job, err)
    assert sorted(done) == ["w0", "w1", "w13", "w2"]
    for w in ("w0", "w1", "w2"):
        assert [r[:2] for r in lines(tmp_path, "resets", w)] == \
            [[str(g), str(3 + (g + 1) % 2)] for g in range(1, 21)], w
    print("2x2: from each kill -9 of a remote rank to the survivors' next step: " +
          ", ".join(f"{t:.2f}" for t in took) + " s")


def test_a_host_cut_off_ten_times_its_ranks_are_evicted_the_others_go_on_new_ones_join(
        bed, tmp_path):
    # Each time hl-b's cable is out until the survivors step without its ranks, then back
    # in: the new workers started for its slots fail over ssh while it is out (a cooldown
    # of 1-2 s each), then start and join at a commit.
    job = _job(bed, tmp_path, "--stall-check-warning-time-seconds", "1",
               "--stall-check-shutdown-time-seconds", "3", "--gloo-timeout-seconds", "8",
               "--blacklist-cooldown-range", "1", "2")
    took = []
    with stopped_at_exit(job):
        until(lambda: full_world(tmp_path, 4), job, "generation 0", 120)
        for k in range(10):
            before = max(g for g, _, _ in stepping(tmp_path).values())
            try:
                bed.link("hl-b", up=False)
                down = time.time()
                until(lambda: full_world(tmp_path, 2), job, f"hl-a's ranks alone, time {k}", 60)
                took.append(first_step_after(tmp_path, before) - down)
            finally:
                bed.link("hl-b", up=True)
            until(lambda: full_world(tmp_path, 4), job, f"hl-b's new workers, time {k}", 120)
        err = _finish(job, tmp_path)
        # hl-b's cut-off ranks give up on their own, or end when they hear they are out.
        deadline = time.monotonic() + 40
        while _job_processes(bed, "hl-b") and time.monotonic() < deadline:
            time.sleep(0.5)
    assert len(re.findall(r"generation \d+: rank [23] \(w\d+, host hl-b\) was named by w[01] as "
                          r"a rank it lost; rank [23] \(w\d+, host hl-b\) was named by w[01] as a "
                          r"rank it lost; generation \d+: 2 rank\(s\) go on", err)) == 10, \
        err[-3000:]
    done = check_finals(tmp_path, job, err)
    assert {"w0", "w1"} < set(done) and len(done) == 4, done
    for w in ("w0", "w1"):  # 2 ranks after each cut, then 4 (hl-b's two joining together
        sizes = "".join(r[1] for r in lines(tmp_path, "resets", w))  # or one by one)
        assert sizes[0] == "2" and sorted(set(sizes.split("2")[1:])) <= ["34", "4"], (w, sizes)
        assert sizes.count("2") == 10, (w, sizes)
    print("2x2, hl-b cut off: from each cut to the survivors' next step: " +
          ", ".join(f"{t:.2f}" for t in took) + " s (stall shutdown 3 s)")


def _partition(bed, up: bool) -> None:
    """hl-a and hl-b stop reaching each other (packets dropped, no reset: a partition);
    both still reach hl-c, where horolite-run runs."""
    b = bed.host("hl-b").address
    for chain, side in (("INPUT", "-s"), ("OUTPUT", "-d")):
        bed.on("hl-a", ["iptables", "-D" if up else "-A", chain, side, b, "-j", "DROP"])


def test_a_partition_whose_halves_both_reach_the_launcher_is_broken_and_heals(bed, tmp_path):
    # Each half names the other as lost (a tie of 2 and 2): the half of the oldest rank
    # goes on, hl-b's ranks are evicted; once the partition heals, new workers join there.
    job = bed.popen("hl-c", [HOROLITE_RUN, "--gloo", "-H", "hl-a:2,hl-b:2", "-np", "4",
                             "--min-np", "2", "--stall-check-warning-time-seconds", "1",
                             "--stall-check-shutdown-time-seconds", "3",
                             "--gloo-timeout-seconds", "8", "--blacklist-cooldown-range", "1",
                             "2", "python", IN_PROCESS, str(tmp_path), "--steps", "100000",
                             "--commit-every", "3", "--sleep", "0.02",
                             "--until-file", str(tmp_path / "stop")],
                    text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    env=dict(os.environ, HOROLITE_MPIRUN="/nonexistent/mpirun"))
    with stopped_at_exit(job):
        until(lambda: full_world(tmp_path, 4), job, "generation 0", 120)
        try:
            _partition(bed, up=False)
            cut = time.time()
            until(lambda: full_world(tmp_path, 2) and {"w0", "w1"} <= set(stepping(tmp_path)),
                  job, "hl-a's ranks alone", 60)
            took = min(float(s[4]) for w in ("w0", "w1") for s in lines(tmp_path, "steps", w)
                       if int(s[0]) > 0 and int(s[2]) == 2) - cut
        finally:
            _partition(bed, up=True)
        until(lambda: full_world(tmp_path, 4), job, "new workers on hl-b", 120)
        err = _finish(job, tmp_path)
    assert re.search(r"rank [23] \(w[23], host hl-b\) and w[01](, w[01])? named each other as "
                     r"lost \(a partition\)", err), err[-3000:]
    done = check_finals(tmp_path, job, err)
    assert {"w0", "w1"} < set(done) and len(done) == 4 and not {"w2", "w3"} & set(done), done
    print(f"2|2 partition, both halves reaching the launcher: hl-a's ranks step alone "
          f"{took:.2f} s after the cut (stall shutdown 3 s)")
