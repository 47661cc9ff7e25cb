"""Elastic training without MPI under random faults: one `horolite-run --gloo -np 4
--min-np 2` job, N faults, and a check that every batch was counted exactly once.

    python bench/elastic_chaos.py --faults 30 [--seed 1] [--kinds kill,stop,pause]

Every few seconds (--every MIN MAX) a random worker among those stepping in the newest
generation is faulted (one at a time, and only while at least --min-np + 1 step, so that
a holder of the state always remains):

- kill: kill -9 of the rank;
- stop: SIGSTOP of the rank for --stall + 2 s (past the stall shutdown), then SIGCONT;
- pause: SIGSTOP of the rank and its wrapper (a paused VM) for as long, then SIGCONT.

The ranks train a sum whose global batch at step s is fixed (each rank adds its share,
by rank and size, so the result does not depend on how many ranks run it); at the end
every finishing rank must hold NumPy's sum over exactly the steps it reports (a batch
counted twice or lost changes it), and the job must end 0. Prints the faults of each
kind, the recoveries, and the longest pause (the longest time no rank stepped); exits 1
when a check fails. The suite runs it with 3 faults (tests/launcher/test_elastic_chaos.py).
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

BATCH = 64  # the global batch: step s adds BATCH values s*BATCH + i


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
        f.write(str(os.getpid()))
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


def _pid(outdir: str, worker: str) -> int:
    with open(os.path.join(outdir, f"pid.{worker}")) as f:
        return int(f.read())


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _signal(pids, signum) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def run_chaos(faults: int, seed: int, kinds, every, stall: float, np_: int, min_np: int,
              commit_every: int, sleep: float, timeout: float, log=print) -> dict:
    from common import horolite_run
    rng = random.Random(seed)
    outdir = tempfile.mkdtemp(prefix="elastic-chaos-")
    cmd = [horolite_run(), "--gloo", "-np", str(np_), "--min-np", str(min_np), "--max-np",
           str(np_), sys.executable, os.path.abspath(__file__), "--rank-side", outdir,
           "--commit-every", str(commit_every), "--sleep", str(sleep)]
    env = dict(os.environ, HOROLITE_MPIRUN="/nonexistent/mpirun",
               HOROLITE_STALL_CHECK_TIME_SECONDS=f"{max(1.0, stall / 2):g}",
               HOROLITE_STALL_SHUTDOWN_TIME_SECONDS=f"{stall:g}")
    err_lines = []
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    reader = threading.Thread(target=lambda: err_lines.extend(proc.stderr), daemon=True)
    reader.start()
    done = collections.Counter()
    held = []  # (pids, resume at) of stopped processes
    started, faulted_in = time.monotonic(), -1  # (the generation the last fault hit)
    result = {"faults": faults, "seed": seed, "done": done, "ok": False}
    try:
        for k in range(faults):
            next_at = time.monotonic() + rng.uniform(*every)
            while True:  # the next fault's time, with a world of more than --min-np
                for pids, at in list(held):
                    if time.monotonic() >= at:
                        _signal(pids[::-1], signal.SIGCONT)  # (the rank first, then its wrapper)
                        held.remove((pids, at))
                if proc.poll() is not None:
                    raise RuntimeError(f"the job ended (code {proc.returncode}) before fault {k}")
                if time.monotonic() - started > timeout:
                    raise RuntimeError(f"fault {k} not reached within {timeout:g} s")
                ready, generation = _stepping(outdir, time.time() - 1.0, faulted_in)
                if time.monotonic() >= next_at and len(ready) > min_np and not held:
                    break
                time.sleep(0.05)
            victim, kind, faulted_in = rng.choice(ready), rng.choice(kinds), generation
            pid = _pid(outdir, victim)
            if kind == "kill":
                _signal([pid], signal.SIGKILL)
            else:
                pids = [pid] if kind == "stop" else [pid, _parent(pid)]
                _signal(pids[::-1], signal.SIGSTOP)  # (the wrapper first: a VM stops at once)
                held.append((pids, time.monotonic() + stall + 2.0))
            done[kind] += 1
            log(f"fault {k + 1}/{faults}: {kind} {victim} at {time.monotonic() - started:.1f} s")
        while held:
            pids, at = held.pop()
            time.sleep(max(0.0, at - time.monotonic()))
            _signal(pids[::-1], signal.SIGCONT)
        deadline = time.monotonic() + timeout
        while len(_stepping(outdir, time.time() - 1.0, faulted_in)[0]) < np_:  # the last join
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the world did not fill up again after the last fault")
            time.sleep(0.05)
        open(os.path.join(outdir, "stop"), "w").close()
        proc.wait(timeout=120)
        reader.join(10)
        result.update(_check(outdir, proc.returncode, "".join(err_lines)))
    except Exception as e:
        result["error"] = str(e)
    finally:
        for pids, _ in held:
            _signal(pids, signal.SIGCONT)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        reader.join(10)
        result["stderr_tail"] = "".join(err_lines)[-6000:]
        for path in glob.glob(os.path.join(outdir, "*")):
            os.unlink(path)
        os.rmdir(outdir)
    result["seconds"] = time.monotonic() - started
    return result


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--faults", type=int, default=30)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--kinds", default="kill,stop,pause",
                   help="comma-separated: kill, stop, pause (picked with equal odds)")
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
    p.add_argument("--rank-side", metavar="OUTDIR", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_side:
        rank_side(args.rank_side, args.commit_every, args.sleep)
        return 0
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    kinds = [k for k in args.kinds.split(",") if k]
    bad = set(kinds) - {"kill", "stop", "pause"}
    if bad or not kinds:
        p.error(f"--kinds: {sorted(bad) or 'none given'}")
    result = run_chaos(args.faults, args.seed, kinds, tuple(args.every), args.stall, args.np,
                       args.min_np, args.commit_every, args.sleep, args.timeout)
    tail = result.pop("stderr_tail")
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
          f"{result['longest_pause_s']:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
