"""Elastic recovery without MPI (horolite-run --gloo --min-np): from a kill -9 to the
survivors' next step, the world's re-formation alone, and what elasticity costs a step
when nothing fails, against the same job started without --min-np, in one run.

    python bench/elastic_in_process.py [--np 2 3 4] [--rounds 2]
    python bench/elastic_in_process.py --np 8 16 --pretend-hosts   # every rank a host

Each rank allreduces a 1 MiB gradient per step and commits every 10 steps. The elastic
job's highest rank is killed once the steps are timed; the survivors (one fewer) go on,
and a new worker started in the free slot joins them at a commit ("join pause": the
longest gap between two steps of rank 0 around it).
Targets (issue 60): kill -9 to the next step <= 1.5 s at 2 x 2 on the bed and <= 3 s at
16 pretend hosts; re-formation <= 0.5 s at 8 ranks; a join pauses the others <= 1 s plus
the state's broadcast; steps elastic/plain <= 1.0 (noise).
"""
from __future__ import annotations

import argparse
import glob
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

WARM, TIMED = 20, 300


def rank_side(outdir: str) -> None:
    import numpy as np
    import horolite as hvd
    from horolite.elastic import ObjectState, in_process, run_fn
    hvd.init()
    me = os.environ.get("HOROLITE_ELASTIC_WORKER") or f"r{hvd.rank()}"
    with open(os.path.join(outdir, f"pid.{me}"), "w") as f:
        f.write(str(os.getpid()))

    state = ObjectState(hvd.broadcast_object, hvd.rank, step=0)
    grad = np.ones(1 << 18, dtype=np.float32)
    stop = os.path.join(outdir, "stop")

    @run_fn
    def train(state):
        log = open(os.path.join(outdir, f"steps.{me}"), "a")
        while True:
            hvd.allreduce(grad, name="grad")
            state.step += 1
            log.write(f"{in_process.generation()} {hvd.size()} {state.step} {time.time():.6f} "
                      f"{in_process.last_rejoin_seconds:.4f}\n")
            log.flush()
            if state.step % 10 == 0:
                state.commit()
                if hvd.allreduce(np.array([float(os.path.exists(stop))]), op=hvd.Max,
                                 name="stop")[0]:
                    return
    train(state)


def _lines(outdir: str, worker: str):
    try:
        with open(os.path.join(outdir, f"steps.{worker}")) as f:
            return [line.split() for line in f if line.endswith("\n")]
    except OSError:
        return []


def _wait(predicate, proc, what: str, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{what}: the job {'ended' if proc.poll() else 'timed out'}:\n"
                               f"{proc.communicate()[1][-3000:]}")
        time.sleep(0.01)


def one_job(np_: int, elastic: bool, pretend: bool) -> dict:
    from common import horolite_run
    run = horolite_run()
    outdir = tempfile.mkdtemp(prefix="elastic-bench-")
    cmd = [run, "--gloo", "-np", str(np_)] + (["--min-np", str(np_ - 1)] if elastic else []) + \
        [sys.executable, os.path.abspath(__file__), "--rank-side", outdir]
    env = dict(os.environ, HOROLITE_MPIRUN="/nonexistent/mpirun")
    if pretend:
        env["HOROLITE_TEST_HOST_IDENTITY"] = "each"
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    first = "w0" if elastic else "r0"
    try:
        _wait(lambda: len(_lines(outdir, first)) >= WARM + TIMED, proc, "steps")
        times = [float(s[3]) for s in _lines(outdir, first)[WARM:WARM + TIMED]]
        out = {"step": (times[-1] - times[0]) / (len(times) - 1)}  # (commits included)
        if elastic:
            victim = f"w{np_ - 1}"
            with open(os.path.join(outdir, f"pid.{victim}")) as f:
                pid = int(f.read())
            killed = time.time()
            os.kill(pid, signal.SIGKILL)
            survivors = [f"w{k}" for k in range(np_ - 1)]

            def after(w):
                return [s for s in _lines(outdir, w) if s[0] != "0"]
            _wait(lambda: all(after(w) for w in survivors), proc, "recovery")
            out["recovery"] = max(float(after(w)[0][3]) for w in survivors) - killed
            out["reform"] = max(float(after(w)[0][4]) for w in survivors)

            def generation(w, g):
                return [s for s in _lines(outdir, w) if s[0] == str(g)]
            # A new worker takes the free slot and joins at a commit: the others' pause.
            _wait(lambda: generation("w0", 2), proc, "the new worker's join")
            out["join"] = float(generation("w0", 2)[0][3]) - float(generation("w0", 1)[-1][3])
        open(os.path.join(outdir, "stop"), "w").close()
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for path in glob.glob(os.path.join(outdir, "*")):
            os.unlink(path)
        os.rmdir(outdir)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--pretend-hosts", action="store_true",
                   help="every rank on a host of its own (HOROLITE_TEST_HOST_IDENTITY=each)")
    p.add_argument("--rank-side", metavar="OUTDIR", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_side:
        rank_side(args.rank_side)
        return
    seen = {}
    for _ in range(args.rounds):
        for n in args.np:
            for elastic in (False, True):
                seen.setdefault((n, elastic), []).append(one_job(n, elastic, args.pretend_hosts))
    where = "pretend hosts" if args.pretend_hosts else "one host"
    print(f"elastic recovery without MPI ({where}, {args.rounds} rounds, medians)")
    print(f"{'np':>3} {'kill -9 -> next step':>21} {'re-formation':>13} {'join pause':>11} "
          f"{'step elastic/plain':>19}")
    for n in args.np:
        plain = statistics.median(r["step"] for r in seen[n, False])
        runs = seen[n, True]
        print(f"{n:>3} {statistics.median(r['recovery'] for r in runs):>19.2f} s "
              f"{statistics.median(r['reform'] for r in runs):>11.3f} s "
              f"{statistics.median(r['join'] for r in runs):>9.2f} s "
              f"{statistics.median(r['step'] for r in runs) / plain:>18.2f}x")


if __name__ == "__main__":
    main()
