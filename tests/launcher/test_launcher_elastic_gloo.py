"""Elastic jobs without MPI end to end on this host: real horolite-run --gloo, real kill -9
and SIGSTOP; survivors go on in their running processes and new workers join.

The rank program (tests/launcher_rank/elastic_in_process.py) trains least squares with a
result independent of the number of ranks, so every run is checked against NumPy. The
multi-host cases are in tests/multihost/test_multihost_elastic_gloo.py.
"""
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from elastic_util import elastic_train
from launcher_util import REPO, wait_until_gone

IN_PROCESS = os.path.join(REPO, "tests", "launcher_rank", "elastic_in_process.py")
NO_MPI = {"HOROLITE_MPIRUN": "/nonexistent/mpirun"}


def lines(outdir, kind, worker):
    try:
        with open(os.path.join(outdir, f"{kind}.{worker}")) as f:
            return [line.split() for line in f]
    except OSError:
        return []


def pid(outdir, worker):
    with open(os.path.join(outdir, f"pid.{worker}")) as f:
        return int(f.read())


def workers(outdir):
    return sorted((n[4:] for n in os.listdir(outdir) if n.startswith("pid.")),
                  key=lambda w: int(w[1:]))


def until(predicate, proc, what, seconds=90):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert proc.poll() is None, f"the job ended early:\n{proc.stderr.read()[-4000:]}"
        if time.monotonic() >= deadline:
            proc.send_signal(signal.SIGINT)
            try:
                _, err = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired as e:
                proc.kill()
                err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) \
                    else (e.stderr or "")
                err += "\n(the job did not end within 30 s of a SIGINT: killed)"
            raise AssertionError(f"{what} did not happen within {seconds} s:\n{err[-6000:]}")
        time.sleep(0.02)


def stepping(outdir):
    """{worker: (generation, rank, size)} of the newest generation any worker stepped in."""
    last = {w: lines(outdir, "steps", w)[-1] for w in workers(outdir)
            if lines(outdir, "steps", w)}
    newest = max((int(s[0]) for s in last.values()), default=-1)
    return {w: (int(s[0]), int(s[1]), int(s[2])) for w, s in last.items() if int(s[0]) == newest}


def full_world(outdir, size):
    now = stepping(outdir)
    return len(now) == size and all(s == size for _, _, s in now.values())


def check_finals(outdir, proc, err):
    """Every worker that ended training holds the same weights, equal to NumPy's run over
    the same number of steps; returns those workers."""
    assert proc.returncode == 0, err[-4000:]
    done = [w for w in workers(outdir) if os.path.exists(os.path.join(outdir, f"final.{w}.npy"))]
    assert done, err[-3000:]
    steps = {int(open(os.path.join(outdir, f"final_step.{w}")).read()) for w in done}
    assert len(steps) == 1, steps
    finals = {w: np.load(os.path.join(outdir, f"final.{w}.npy")) for w in done}
    for w, got in finals.items():
        assert np.array_equal(got, finals[done[0]]), f"{w} differs from {done[0]}"
    np.testing.assert_allclose(finals[done[0]], elastic_train.reference(steps.pop()),
                               rtol=1e-12, atol=1e-12)
    for w in done:  # every reset happened in the process that started: nothing restarted
        assert {r[2] for r in lines(outdir, "resets", w)} <= {str(pid(outdir, w))}
    return done


def first_step_after(outdir, generation):
    return min(float(s[4]) for w in workers(outdir) for s in lines(outdir, "steps", w)
               if int(s[0]) > generation)


def start_job(start, tmp_path, np_, min_np, *extra, env=None, script_args=()):
    return start("--gloo", "-np", np_, "--min-np", min_np, *extra, sys.executable, IN_PROCESS,
                 tmp_path, "--steps", 100000, "--commit-every", 3, "--sleep", 0.02,
                 "--until-file", tmp_path / "stop", *script_args,
                 env=dict(NO_MPI, **(env or {})))


def finish(proc, tmp_path):
    (tmp_path / "stop").write_text("")
    out, err = proc.communicate(timeout=120)
    assert not wait_until_gone(str(tmp_path), 5)
    return err


@pytest.mark.parametrize("np_,victim", [(2, 0), (3, 1), (4, 1)])
def test_kill9_survivors_go_on_and_a_new_worker_joins(start, tmp_path, np_, victim):
    # Every rank on a pretend host of its own, in every generation: the worlds' data go
    # over horolite's TCP connections as across real hosts (the other tests: one host).
    proc = start_job(start, tmp_path, np_, np_ - 1, env={"HOROLITE_TEST_HOST_IDENTITY": "each",
                                                         "HOROLITE_LOG_LEVEL": "INFO"})
    until(lambda: full_world(tmp_path, np_), proc, "generation 0")
    killed_at = time.time()
    os.kill(pid(tmp_path, f"w{victim}"), signal.SIGKILL)
    # The survivors go on at once, one rank fewer; a new worker joins at a commit.
    until(lambda: full_world(tmp_path, np_) and stepping(tmp_path).get(f"w{np_}", (-1,))[0] == 2, proc,
          "the new worker's join")
    err = finish(proc, tmp_path)
    assert re.search(rf"generation 0: rank {victim} \(w{victim}, host localhost\) was killed by "
                     rf"signal 9 \(SIGKILL\); generation 1: {np_ - 1} rank\(s\) go on in their "
                     "running processes", err), err[-3000:]
    assert f"generation 1: w{np_} (host localhost) joins; generation 2: {np_} rank(s), from " \
           "the next commit" in err, err[-3000:]
    survivors = [f"w{k}" for k in range(np_) if k != victim]
    # Survivors keep their connections to each other; only the new worker's are new.
    for generation in (1, 2) if np_ > 2 else ():
        kept = re.findall(rf"generation {generation}, (\d+) kept from the one before", err)
        assert sorted(kept, key=int)[-(np_ - 1):] == [str(np_ - 2)] * (np_ - 1), \
            (generation, kept, err[-3000:])
    for w in survivors:
        assert [r[:2] for r in lines(tmp_path, "resets", w)] == [["1", str(np_ - 1)],
                                                                 ["2", str(np_)]], w
        steps = lines(tmp_path, "steps", w)
        first_after = next(int(s[3]) for s in steps if s[0] == "1")
        last_before = max(int(s[3]) for s in steps if s[0] == "0")
        assert first_after % 3 == 1 and last_before - 3 < first_after <= last_before + 1, \
            (w, last_before, first_after)  # from the last commit
    # The oldest survivor is rank 0 of the new world, the others keep their order; the
    # new worker comes last.
    assert [int(lines(tmp_path, "steps", w)[-1][1]) for w in survivors + [f"w{np_}"]] == \
        list(range(np_))
    assert sorted(check_finals(tmp_path, proc, err)) == sorted(survivors + [f"w{np_}"])
    print(f"np {np_}: from kill -9 to the survivors' next step: "
          f"{first_step_after(tmp_path, 0) - killed_at:.2f} s")


def test_ten_kills_in_a_row_in_one_job(start, tmp_path):
    np_, times = 3, []
    proc = start_job(start, tmp_path, np_, np_ - 1)
    for kill in range(10):
        until(lambda: full_world(tmp_path, np_), proc, f"a full world before kill {kill}")
        now = stepping(tmp_path)
        victim = next(w for w, (_, rank, _) in now.items() if rank == kill % np_)
        generation = max(g for g, _, _ in now.values())
        killed_at = time.time()
        os.kill(pid(tmp_path, victim), signal.SIGKILL)
        until(lambda: any(int(s[0]) > generation for w in workers(tmp_path)
                          for s in lines(tmp_path, "steps", w)), proc, f"recovery {kill}")
        times.append(first_step_after(tmp_path, generation) - killed_at)
    err = finish(proc, tmp_path)
    assert len(re.findall(r"was killed by signal 9 \(SIGKILL\); generation \d+: 2 rank\(s\) go "
                          "on in their running processes", err)) == 10, err[-4000:]
    check_finals(tmp_path, proc, err)
    print("from each kill -9 to the survivors' next step: " +
          ", ".join(f"{t:.2f}" for t in times) + " s")


def _newest(outdir) -> int:
    return max((g for g, _, _ in stepping(outdir).values()), default=-1)


def _at_rank(outdir, rank):
    return next(w for w, (_, r, _) in stepping(outdir).items() if r == rank)


def test_ranks_that_hang_are_named_and_evicted_ten_times_in_a_row(start, tmp_path):
    np_, stopped = 3, []
    proc = start_job(start, tmp_path, np_, 2, env={"HOROLITE_STALL_CHECK_TIME_SECONDS": "1",
                                                   "HOROLITE_STALL_SHUTDOWN_TIME_SECONDS": "2"})
    for time_ in range(10):
        until(lambda: full_world(tmp_path, np_), proc, f"a full world before stop {time_}")
        victim, before = _at_rank(tmp_path, 1 + time_ % 2), _newest(tmp_path)
        os.kill(pid(tmp_path, victim), signal.SIGSTOP)
        stopped.append(victim)
        until(lambda: _newest(tmp_path) > before and victim not in stepping(tmp_path), proc,
              f"the world without {victim}")
    err = finish(proc, tmp_path)
    for victim in stopped:
        assert re.search(rf"rank \d \({victim}, host localhost\) was named by w\d+ as a rank it "
                         r"lost; generation \d+: 2 rank\(s\) go on", err), (victim, err[-3000:])
    assert not set(stopped) & set(check_finals(tmp_path, proc, err))


def _parent(pid_):
    with open(f"/proc/{pid_}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_a_paused_worker_evicted_then_resumed_ends_quietly_and_the_job_goes_on(start, tmp_path):
    # A paused VM: the rank and its wrapper stop past the stall shutdown, the survivors
    # evict it and go on, then it resumes: it meets its peers' FENCE (LinkLost), finds at
    # the rendezvous that it was left out and ends; the job is not ended for it.
    proc = start_job(start, tmp_path, 3, 2, env={"HOROLITE_STALL_CHECK_TIME_SECONDS": "1",
                                                 "HOROLITE_STALL_SHUTDOWN_TIME_SECONDS": "2",
                                                 "HOROLITE_LOG_LEVEL": "INFO"})
    until(lambda: full_world(tmp_path, 3), proc, "generation 0")
    rank_pid = pid(tmp_path, "w0")  # (rank 0: the others' sync source until it is evicted)
    wrapper = _parent(rank_pid)
    for p_ in (wrapper, rank_pid):
        os.kill(p_, signal.SIGSTOP)
    try:
        until(lambda: _newest(tmp_path) > 0 and "w0" not in stepping(tmp_path), proc,
              "the world without w0")
    finally:
        os.kill(rank_pid, signal.SIGCONT)
        time.sleep(2)  # (the driver's SIGTERM waits at the stopped wrapper meanwhile)
        os.kill(wrapper, signal.SIGCONT)
    until(lambda: full_world(tmp_path, 3), proc, "a new worker's join")
    err = finish(proc, tmp_path)
    assert re.search(r"rank 0 \(w0, host localhost\) was named by w\d as a rank it lost", err), \
        err[-3000:]
    assert re.search(r"w0 is not in generation \d+ of the job; this worker ends", err), err[-3000:]
    assert "the training code raised" not in err, err[-3000:]
    assert sorted(check_finals(tmp_path, proc, err)) == ["w1", "w2", "w3"]
    # Each keeps its slot on the host (the GPU it pinned by hvd.local_rank() stays its
    # own); w3 takes w0's, not a survivor's.
    assert {w: {r[0] for r in lines(tmp_path, "local", w)} for w in ("w1", "w2", "w3")} == \
        {"w1": {"1"}, "w2": {"2"}, "w3": {"0"}}


def test_a_failure_while_the_world_forms_again_ten_times_in_a_row(start, tmp_path):
    np_ = 4
    proc = start_job(start, tmp_path, np_, 2)
    for time_ in range(10):
        until(lambda: full_world(tmp_path, np_), proc, f"a full world before kill {time_}")
        first, second, before = _at_rank(tmp_path, 3), _at_rank(tmp_path, 2), _newest(tmp_path)
        os.kill(pid(tmp_path, first), signal.SIGKILL)
        # the second dies while the others leave for the world without the first
        time.sleep(0.05)
        os.kill(pid(tmp_path, second), signal.SIGKILL)
        until(lambda: _newest(tmp_path) > before and not {first, second} & set(stepping(tmp_path)),
              proc, f"the world after kills {time_}")
    err = finish(proc, tmp_path)
    assert {"w0", "w1"} <= set(check_finals(tmp_path, proc, err)), err[-4000:]


def test_a_rank_that_hangs_while_the_world_forms_again_is_evicted(start, tmp_path):
    # kill -9 of rank 3, then rank 2 stops while the survivors leave for the next world:
    # the world forms without both within --gloo-timeout-seconds (not --elastic-timeout)
    proc = start_job(start, tmp_path, 4, 2, "--gloo-timeout-seconds", 5,
                     env={"HOROLITE_STALL_CHECK_TIME_SECONDS": "1",
                          "HOROLITE_STALL_SHUTDOWN_TIME_SECONDS": "2"})
    until(lambda: full_world(tmp_path, 4), proc, "generation 0")
    stopped = pid(tmp_path, "w2")
    os.kill(pid(tmp_path, "w3"), signal.SIGKILL)
    time.sleep(0.05)
    os.kill(stopped, signal.SIGSTOP)
    started = time.monotonic()
    try:
        until(lambda: {"w0", "w1"} <= set(stepping(tmp_path)) and
              not {"w2", "w3"} & set(stepping(tmp_path)), proc, "a world without w2 and w3",
              seconds=40)
        took = time.monotonic() - started
    finally:
        try:
            os.kill(stopped, signal.SIGCONT)
        except ProcessLookupError:
            pass
    err = finish(proc, tmp_path)
    assert re.search(r"rank 2 \(w2, host localhost\) (was named by w\d|did not arrive|and w\d)",
                     err), err[-3000:]
    assert {"w0", "w1"} <= set(check_finals(tmp_path, proc, err))
    print(f"from the SIGSTOP to a world without it: {took:.1f} s")


def test_a_new_worker_joins_at_a_commit_further_off_than_the_elastic_timeout(start, tmp_path):
    proc = start("--gloo", "-np", 2, "--min-np", 1, "--elastic-timeout", 3, sys.executable,
                 IN_PROCESS, tmp_path, "--steps", 100000, "--commit-every", 250, "--sleep", 0.02,
                 "--until-file", tmp_path / "stop", env=NO_MPI)
    until(lambda: full_world(tmp_path, 2), proc, "generation 0")
    os.kill(pid(tmp_path, "w1"), signal.SIGKILL)
    until(lambda: stepping(tmp_path).get("w2", (-1,))[0] >= 2, proc, "w2's join", seconds=60)
    err = finish(proc, tmp_path)
    assert "generation 1: w2 (host localhost) joins; generation 2: 2 rank(s)" in err, err[-3000:]
    assert "did not form" not in err, err[-3000:]
    assert sorted(check_finals(tmp_path, proc, err)) == ["w0", "w2"]


def test_an_error_of_the_training_code_ends_the_job(start, tmp_path):
    proc = start("--gloo", "-np", 3, "--min-np", 2, sys.executable, IN_PROCESS, tmp_path,
                 "--steps", 30, "--raise-at", 5, env=NO_MPI)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err[-3000:]
    assert re.search(r"the training code raised on w1 \(host localhost\): rank 1 raised "
                     r"ValueError: bad batch at step 5.*not retried", err), err[-3000:]
    assert not wait_until_gone(str(tmp_path), 5)


@pytest.mark.parametrize("flag, raised", [
    ("--typo-at-setup", r"rank \d raised AttributeError: .*brodcast_object"),
    ("--raise-after-train", r"rank 1 raised ValueError: no checkpoint directory after step 6")])
def test_an_error_outside_run_ends_the_job_with_it(start, tmp_path, flag, raised):
    # (as over MPI: a typo at set-up is not retried with new workers for ever, and an
    # error after train() returns is not dropped)
    proc = start("--gloo", "-np", 2, "--min-np", 1, sys.executable, IN_PROCESS, tmp_path,
                 "--steps", 6, "--sleep", 0, flag, env=NO_MPI)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err[-3000:]
    assert re.search(r"the training code raised on w\d \(host localhost\): " + raised +
                     ".*not retried", err), err[-3000:]
    assert "starts on localhost, to join" not in err, err[-3000:]
    assert not wait_until_gone(str(tmp_path), 5)


def test_below_min_np_the_survivor_waits_for_a_new_worker(start, tmp_path):
    proc = start_job(start, tmp_path, 2, 2)
    until(lambda: full_world(tmp_path, 2), proc, "generation 0")
    os.kill(pid(tmp_path, "w1"), signal.SIGKILL)
    until(lambda: stepping(tmp_path).get("w2", (-1,))[0] >= 1, proc, "w2's join")
    err = finish(proc, tmp_path)
    assert "1 rank(s) left, fewer than --min-np 2: waiting up to --elastic-timeout" in err
    assert re.search(r"generation 0: rank 1 \(w1, host localhost\) was killed by signal 9 "
                     r"\(SIGKILL\); w2 \(host localhost\) joins; generation 1: 2 rank\(s\)",
                     err), err[-3000:]
    assert sorted(check_finals(tmp_path, proc, err)) == ["w0", "w2"]


def test_every_member_lost_ends_the_job_instead_of_training_from_scratch(start, tmp_path):
    proc = start_job(start, tmp_path, 2, 1)
    until(lambda: full_world(tmp_path, 2), proc, "generation 0")
    for w in ("w0", "w1"):
        os.kill(pid(tmp_path, w), signal.SIGKILL)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err[-3000:]
    # (both deaths seen in one turn of the launcher's watch, or one after the other)
    assert re.search(r"generation \d: rank \d \(w\d, host localhost\) was killed by signal 9 .*"
                     "no worker left holds the training state", err), err[-3000:]
    assert not wait_until_gone(str(tmp_path), 10)


def test_when_horolite_run_dies_every_worker_ends(start, tmp_path):
    proc = start_job(start, tmp_path, 3, 2)
    until(lambda: full_world(tmp_path, 3), proc, "generation 0")
    proc.kill()  # SIGKILL: no clean-up of its own
    proc.wait()
    assert not wait_until_gone(str(tmp_path), 10), "workers outlived horolite-run"


def test_slots_from_the_discovery_script_join_and_leave_at_a_commit_ten_times(start, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    proc = start_job(start, tmp_path, 2, 1, "--host-discovery-script", script)
    until(lambda: full_world(tmp_path, 2), proc, "generation 0")
    joined = []
    for time_ in range(10):
        hosts.write_text("localhost:3\n")
        until(lambda: full_world(tmp_path, 3), proc, f"a join, time {time_}")
        joined.append(_at_rank(tmp_path, 2))
        hosts.write_text("localhost:2\n")
        until(lambda: full_world(tmp_path, 2) and joined[-1] not in stepping(tmp_path), proc,
              f"{joined[-1]}'s leaving")
    err = finish(proc, tmp_path)
    assert joined == [f"w{k}" for k in range(2, 12)], joined
    for k, w in enumerate(joined):
        assert f"generation {2 * k}: {w} (host localhost) joins; generation {2 * k + 1}: 3 " \
               "rank(s), from the next commit" in err, (w, err[-3000:])
        assert f"generation {2 * k + 1}: rank 2 ({w}) leaves: host localhost offers fewer " \
               f"slots; generation {2 * k + 2}: 2 rank(s), from the next commit" in err, \
            (w, err[-3000:])
        # each left when its plan left it out: it ended well, without its final state
        assert lines(tmp_path, "steps", w) and not os.path.exists(tmp_path / f"final.{w}.npy")
    assert sorted(check_finals(tmp_path, proc, err)) == ["w0", "w1"]


def test_a_host_where_a_new_worker_fails_to_start_cools_down(start, tmp_path):
    proc = start_job(start, tmp_path, 3, 2, "--blacklist-cooldown-range", 1, 1,
                     script_args=("--fail-first-join", tmp_path / "failed-once"))
    until(lambda: full_world(tmp_path, 3), proc, "generation 0")
    os.kill(pid(tmp_path, "w2"), signal.SIGKILL)
    until(lambda: "w4" in stepping(tmp_path) and full_world(tmp_path, 3), proc, "w4's join")
    err = finish(proc, tmp_path)
    assert re.search(r"w3 \(host localhost\) exited with code 1 before it joined; no new worker "
                     r"starts there while it is blacklisted: .*localhost \(w3 exited with code "
                     r"1 before it joined; for \d+ s more\)", err), err[-3000:]
    assert sorted(check_finals(tmp_path, proc, err)) == ["w0", "w1", "w4"]


def test_reset_limit_ends_the_job_at_the_reset_past_it(start, tmp_path):
    # (the worker started in the free slot fails at once: no join counts as a reset here)
    proc = start_job(start, tmp_path, 3, 1, "--reset-limit", 1,
                     script_args=("--fail-first-join", tmp_path / "failed-once"))
    until(lambda: full_world(tmp_path, 3), proc, "generation 0")
    os.kill(pid(tmp_path, "w2"), signal.SIGKILL)  # reset 1: the survivors go on
    until(lambda: stepping(tmp_path).get("w0", (-1,))[0] >= 1, proc, "generation 1")
    os.kill(pid(tmp_path, "w1"), signal.SIGKILL)  # reset 2: past the limit
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err[-3000:]
    assert re.search(r"rank \d \(w1, host localhost\) was killed by signal 9 \(SIGKILL\); that "
                     r"is reset 2, more than --reset-limit 1: the job fails", err), err[-3000:]
    assert not wait_until_gone(str(tmp_path), 10)


def test_a_discovery_script_that_fails_at_first_ends_the_job_naming_it(run, tmp_path):
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho 'no cluster here' >&2\nexit 3\n")
    script.chmod(0o755)
    r = run("--gloo", "-np", 2, "--min-np", 1, "--host-discovery-script", script,
            sys.executable, IN_PROCESS, tmp_path, env=NO_MPI)
    assert r.returncode == 1, r.stderr
    assert "horolite-run: elastic: the job fails: " in r.stderr and "discover.sh" in r.stderr, \
        r.stderr
    assert "Traceback" not in r.stderr
