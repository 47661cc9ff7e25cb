"""Elastic training without MPI under random faults: one `horolite-run --gloo -np 4
--min-np 2` job, N faults, and a check that every batch was counted exactly once.

    python bench/elastic_chaos.py --faults 30 [--seed 1] [--kinds kill,stop,pause]
    python bench/elastic_chaos.py --bed --faults 30   # across simulated hosts (root)

Every few seconds (--every MIN MAX) a random worker among those stepping in the newest
generation is faulted (one at a time, and only while at least --min-np + 1 step, so that
a holder of the state always remains):

- kill: kill -9 of the rank;
- stop: SIGSTOP of the rank for --stall + 2 s (past the stall shutdown), then SIGCONT;
- pause: SIGSTOP of the rank and its wrapper (a paused VM) for as long, then SIGCONT;
- cut (--bed only): a host's cable out of the switch for --cut-seconds, then back in
  (drawn only while the other host alone has at least --min-np ranks stepping).

With --bed the job runs across simulated hosts (tests/multihost/bed.py: namespaces, real
sshd): `horolite-run --gloo -H hl-a:2,hl-b:2` started on hl-c, so that a cut host loses
its peers and the launcher alike; the default kinds there are kill, stop and cut.

The ranks train a sum whose global batch at step s is fixed (each rank adds its share,
by rank and size, so the result does not depend on how many ranks run it); at the end
every finishing rank must hold NumPy's sum over exactly the steps it reports (a batch
counted twice or lost changes it), and the job must end 0. Prints the faults of each
kind, the recoveries, the longest pause (the longest time no rank stepped) and, for each
kill -9 and cut, the time to the survivors' next step; exits 1 when a check fails. The suite runs
it with 3 faults (tests/launcher/test_elastic_chaos.py; on the bed,
tests/multihost/test_multihost_elastic_chaos.py).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

BATCH = 64  # the global batch: step s adds BATCH values s*BATCH + i
BED_HOSTS = "hl-a:2,hl-b:2"  # --bed: the ranks' hosts; horolite-run runs on hl-c


def reference(steps: int):
    import numpy as np
    return sum((np.arange(BATCH, dtype=np.float64) + s * BATCH for s in range(steps)),
               np.zeros(BATCH))


def rank_side(outdir: str, commit_every: int, sleep: float) -> None:
    import numpy as np
    import horolite as hvd
    from horolite.elastic import ObjectState, in_process, run_fn
    hvd.init()
    me = os.environ["HOROLITE_ELASTIC_WORKER"]
    with open(os.path.join(outdir, f"pid.{me}"), "w") as f:
        f.write(f"{os.getpid()} {socket.gethostname()}")
    state = ObjectState(hvd.broadcast_object, hvd.rank, total=np.zeros(BATCH), step=0)
    stop = os.path.join(outdir, "stop")

    @run_fn
    def train(state):
        log = open(os.path.join(outdir, f"steps.{me}"), "a")
        while True:
            size, rank = hvd.size(), hvd.rank()
            share = np.zeros(BATCH)
            part = slice(rank * BATCH // size, (rank + 1) * BATCH // size)
            share[part] = (np.arange(BATCH, dtype=np.float64) + state.step * BATCH)[part]
            state.total = state.total + hvd.allreduce(share, op=hvd.Sum, name="batch")
            state.step += 1
            log.write(f"{in_process.generation()} {rank} {size} {state.step} {time.time():.6f}\n")
            log.flush()
            time.sleep(sleep)
            if state.step % commit_every == 0:
                state.commit()
                if hvd.allreduce(np.array([float(os.path.exists(stop))]), op=hvd.Max,
                                 name="stop")[0]:
                    return
    train(state)
    np.save(os.path.join(outdir, f"final.{me}.npy"), state.total)
    with open(os.path.join(outdir, f"final_step.{me}"), "w") as f:
        f.write(str(state.step))


def _steps(outdir: str):
    """{worker: [(generation, rank, size, step, time)]} as written so far."""
    found = {}
    for path in glob.glob(os.path.join(outdir, "steps.*")):
        with open(path) as f:
            rows = [line.split() for line in f if line.endswith("\n")]
        found[path.rsplit(".", 1)[1]] = [(int(g), int(r), int(n), int(s), float(t))
                                         for g, r, n, s, t in rows]
    return found


def _stepping(outdir: str, since: float, after: int = -1):
    """Workers that stepped in the newest generation, if newer than `after`, after `since`
    (time.time()); and that generation."""
    steps = _steps(outdir)
    newest = max((rows[-1][0] for rows in steps.values() if rows), default=-1)
    if newest <= after:
        return [], newest
    return sorted(w for w, rows in steps.items()
                  if rows and rows[-1][0] == newest and rows[-1][4] > since), newest


def _where(outdir: str, worker: str):
    """(pid as the worker sees it, its host name)."""
    with open(os.path.join(outdir, f"pid.{worker}")) as f:
        pid, host = f.read().split()
    return int(pid), host


def _pid(outdir: str, worker: str, bed=None) -> int:
    """The worker's pid as this process sees it (on the bed: translated out of its host's
    PID namespace through /proc/PID/status's NSpid)."""
    pid, host = _where(outdir, worker)
    if bed is None:
        return pid
    for candidate in bed.host(host).pids():
        try:
            with open(f"/proc/{candidate}/status") as f:
                nspid = next(line.split() for line in f if line.startswith("NSpid:"))
        except (OSError, StopIteration):
            continue
        if int(nspid[-1]) == pid:
            return candidate
    raise RuntimeError(f"{worker} (pid {pid}) is not running on {host}")


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _signal(pids, signum) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _launch(cmd, env, bed):
    """horolite-run here, or on the bed's hl-c (ranks on BED_HOSTS) with a short gloo
    timeout and a cooldown, so that a host cut off for a while is tried again."""
    if bed is None:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)
    cmd = cmd[:2] + ["-H", BED_HOSTS, "--gloo-timeout-seconds", "8",
                     "--blacklist-cooldown-range", "1", "2"] + cmd[2:]
    return bed.popen("hl-c", cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                     text=True)


def _fault(kind, victim, outdir, bed, hold: float, cut: float):
    """Strike `victim` (for a cut: its host); returns how to undo it, or None."""
    if kind == "cut":
        host = _where(outdir, victim)[1]
        bed.link(host, up=False)
        return lambda: bed.link(host, up=True), time.monotonic() + cut
    pid = _pid(outdir, victim, bed)
    if kind == "kill":
        _signal([pid], signal.SIGKILL)
        return None
    pids = [pid] if kind == "stop" else [pid, _parent(pid)]
    _signal(pids[::-1], signal.SIGSTOP)  # (the wrapper first: a VM stops at once)
    return lambda: _signal(pids[::-1], signal.SIGCONT), time.monotonic() + hold


def _can_strike(kind, ready, outdir, min_np: int) -> bool:
    """Whether `kind` leaves at least --min-np ranks stepping (a holder of the state)."""
    if kind != "cut":
        return len(ready) > min_np
    hosts = collections.Counter(_where(outdir, w)[1] for w in ready)
    return len(hosts) > 1 and len(ready) - max(hosts.values()) >= min_np


def run_chaos(faults: int, seed: int, kinds, every, stall: float, np_: int, min_np: int,
              commit_every: int, sleep: float, timeout: float, log=print, bed=None,
              cut: float = 5.0) -> dict:
    from common import horolite_run
    rng = random.Random(seed)
    drawn = [rng.choice(kinds) for _ in range(faults)]  # (fixed by the seed alone)
    outdir = tempfile.mkdtemp(prefix="elastic-chaos-")
    cmd = [horolite_run(), "--gloo", "-np", str(np_), "--min-np", str(min_np), "--max-np",
           str(np_), sys.executable, os.path.abspath(__file__), "--rank-side", outdir,
           "--commit-every", str(commit_every), "--sleep", str(sleep)]
    env = dict(os.environ, HOROLITE_MPIRUN="/nonexistent/mpirun",
               HOROLITE_STALL_CHECK_TIME_SECONDS=f"{max(1.0, stall / 2):g}",
               HOROLITE_STALL_SHUTDOWN_TIME_SECONDS=f"{stall:g}")
    err_lines = []
    proc = _launch(cmd, env, bed)
    reader = threading.Thread(target=lambda: err_lines.extend(proc.stderr), daemon=True)
    reader.start()
    done = collections.Counter()
    held = []  # (undo, at) of stopped processes and cut cables
    struck = {"kill": [], "cut": []}  # (time.time(), generation hit, the workers it took)
    started, faulted_in = time.monotonic(), -1  # (the generation the last fault hit)
    result = {"faults": faults, "seed": seed, "done": done, "ok": False}
    try:
        for k, kind in enumerate(drawn):
            next_at = time.monotonic() + rng.uniform(*every)
            while True:  # the next fault's time, with enough ranks left after it
                for undo, at in list(held):
                    if time.monotonic() >= at:
                        undo()
                        held.remove((undo, at))
                if proc.poll() is not None:
                    raise RuntimeError(f"the job ended (code {proc.returncode}) before fault {k}")
                if time.monotonic() - started > timeout:
                    raise RuntimeError(f"fault {k} not reached within {timeout:g} s")
                ready, generation = _stepping(outdir, time.time() - 1.0, faulted_in)
                if time.monotonic() >= next_at and not held and \
                        _can_strike(kind, ready, outdir, min_np):
                    break
                time.sleep(0.05)
            victim, faulted_in = rng.choice(ready), generation
            struck_at = time.time()
            undo = _fault(kind, victim, outdir, bed, stall + 2.0, cut)
            if undo:
                held.append(undo)
            if kind in struck:
                struck[kind].append((struck_at, generation, {victim} if kind == "kill" else {
                    w for w in ready if _where(outdir, w)[1] == _where(outdir, victim)[1]}))
            done[kind] += 1
            log(f"fault {k + 1}/{faults}: {kind} {victim} at {time.monotonic() - started:.1f} s")
        while held:
            undo, at = held.pop()
            time.sleep(max(0.0, at - time.monotonic()))
            undo()
        deadline = time.monotonic() + timeout
        while len(_stepping(outdir, time.time() - 1.0, faulted_in)[0]) < np_:  # the last join
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the world did not fill up again after the last fault")
            time.sleep(0.05)
        open(os.path.join(outdir, "stop"), "w").close()
        proc.wait(timeout=120)
        reader.join(10)
        result.update(_check(outdir, proc.returncode, "".join(err_lines)))
        for kind, strikes in struck.items():
            result[f"{kind}_to_next_step_s"] = _to_next_step(outdir, strikes)
    except Exception as e:
        result["error"] = str(e)
    finally:
        for undo, _ in held:
            undo()
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        reader.join(10)
        result["stderr"] = "".join(err_lines)
        result["stderr_tail"] = result["stderr"][-6000:]
        for path in glob.glob(os.path.join(outdir, "*")):
            os.unlink(path)
        os.rmdir(outdir)
    result["seconds"] = time.monotonic() - started
    return result


def _to_next_step(outdir: str, strikes):
    """For each kill -9 (or cut): seconds from it to the first step a worker it did not take
    took in a newer generation than the one it hit (the survivors' next step)."""
    rows = [(row[4], row[0], w) for w, found in _steps(outdir).items() for row in found]
    took = []
    for at, generation, taken in strikes:
        after = [t for t, g, w in rows if g > generation and w not in taken and t > at]
        took.append(round(min(after) - at, 3) if after else None)
    return took


def _check(outdir: str, code: int, err: str) -> dict:
    import numpy as np
    out = {"exit_code": code,
           "recoveries": len(re.findall(r"go on in their running processes", err)),
           "joins": len(re.findall(r"\) joins", err)),
           "evicted_named": len(re.findall(r"was named by w\d+ as a rank it lost", err)),
           "left_out_ended": len(re.findall(r"of the job; this worker ends", err))}
    times = sorted(row[4] for rows in _steps(outdir).values() for row in rows)
    out["longest_pause_s"] = max((b - a for a, b in zip(times, times[1:])), default=0.0)
    finals = {p.rsplit(".", 2)[1]: np.load(p)
              for p in glob.glob(os.path.join(outdir, "final.*.npy"))}
    steps = {}
    for w in finals:
        with open(os.path.join(outdir, f"final_step.{w}")) as f:
            steps[w] = int(f.read())
    problems = []
    if code != 0:
        problems.append(f"the job ended with code {code}")
    if not finals:
        problems.append("no rank finished")
    if len(set(steps.values())) > 1:
        problems.append(f"the finishing ranks stopped at different steps: {steps}")
    for w, total in finals.items():
        if not np.array_equal(total, reference(steps[w])):
            problems.append(f"{w}: its sum over {steps[w]} steps is not NumPy's")
    out.update(finishing=sorted(finals), steps=max(steps.values(), default=0),
               problems=problems, ok=not problems)
    return out


def _spread(seconds) -> str:
    known = sorted(t for t in seconds if t is not None)
    if not known:
        return "none"
    return (f"median {known[len(known) // 2]:.2f} s, max {known[-1]:.2f} s over {len(known)}"
            + (f" ({len(seconds) - len(known)} without a next step)"
               if len(known) < len(seconds) else ""))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--faults", type=int, default=30)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--kinds", help="comma-separated: kill, stop, pause, cut (--bed only), "
                   "picked with equal odds (default kill,stop,pause; with --bed kill,stop,cut)")
    p.add_argument("--bed", action="store_true",
                   help=f"across simulated hosts: ranks on {BED_HOSTS}, horolite-run on hl-c")
    p.add_argument("--cut-seconds", type=float, default=5.0,
                   help="how long a cut host stays off the switch")
    p.add_argument("--every", type=float, nargs=2, default=(4.0, 7.0), metavar=("MIN", "MAX"),
                   help="seconds between two faults, uniform in [MIN, MAX]")
    p.add_argument("--stall", type=float, default=3.0,
                   help="HOROLITE_STALL_SHUTDOWN_TIME_SECONDS; stops last 2 s longer")
    p.add_argument("--np", type=int, default=4)
    p.add_argument("--min-np", type=int, default=2)
    p.add_argument("--commit-every", type=int, default=5)
    p.add_argument("--sleep", type=float, default=0.02, help="seconds per step")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--json", metavar="FILE", help="also write the result here")
    p.add_argument("--log", metavar="FILE", help="write horolite-run's log here")
    p.add_argument("--rank-side", metavar="OUTDIR", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_side:
        rank_side(args.rank_side, args.commit_every, args.sleep)
        return 0
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    kinds = [k for k in (args.kinds or ("kill,stop,cut" if args.bed else "kill,stop,pause"))
             .split(",") if k]
    bad = set(kinds) - {"kill", "stop", "pause"} - ({"cut"} if args.bed else set())
    if bad or not kinds:
        p.error(f"--kinds: {sorted(bad) or 'none given'}")
    if args.bed and args.np != 4:
        p.error(f"--bed runs {BED_HOSTS}: -np 4")
    with contextlib.ExitStack() as stack:
        from common import simulated_hosts
        bed = stack.enter_context(simulated_hosts(3, "", "elastic_chaos")) if args.bed else None
        result = run_chaos(args.faults, args.seed, kinds, tuple(args.every), args.stall,
                           args.np, args.min_np, args.commit_every, args.sleep, args.timeout,
                           bed=bed, cut=args.cut_seconds)
    tail, err = result.pop("stderr_tail"), result.pop("stderr")
    if args.log:
        with open(args.log, "w") as f:
            f.write(err)
    print(json.dumps(result, default=dict, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, default=dict, indent=1)
    if not result.get("ok"):
        print(tail, file=sys.stderr)
        return 1
    print(f"{args.faults} faults ({', '.join(f'{n} {k}' for k, n in result['done'].items())}): "
          f"exit 0, {result['steps']} steps, exact on {len(result['finishing'])} ranks; "
          f"{result['recoveries']} recoveries, {result['joins']} joins; longest pause "
          f"{result['longest_pause_s']:.2f} s; kill -9 to the survivors' next step: "
          f"{_spread(result['kill_to_next_step_s'])}" + (
              f"; a cut to it: {_spread(result['cut_to_next_step_s'])}"
              if result["cut_to_next_step_s"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
