"""An elastic training run whose result is known: least squares by gradient descent.

Every step uses a global batch of GLOBAL samples made from the step number alone; rank
r of n takes a contiguous n-th of it, so the averaged gradient (and every weight) does
not depend on how many ranks there are: the reference is plain NumPy (reference()).

Per rank it writes into OUTDIR: ``pid.<gen>.<rank>`` (its process id, for the test to
kill), appends ``<gen> <rank> <size> <step> <time>`` to ``steps.<gen>.<rank>`` after each
step, ``resumed.<gen>.<rank>`` (the step it resumed at) and at the end ``final.<rank>.npy``.
"""
import argparse
import os
import sys
import time

import numpy as np

DIM = 8
GLOBAL = 12  # divisible by 1, 2, 3 and 4 ranks
LR = 0.05


def batch(step):
    rng = np.random.default_rng(1000 + step)
    x = rng.standard_normal((GLOBAL, DIM))
    y = x @ np.arange(1, DIM + 1, dtype=np.float64) + 0.1 * rng.standard_normal(GLOBAL)
    return x, y


def gradient(w, x, y):
    return 2.0 * x.T @ (x @ w - y) / len(y)


def reference(steps):
    w = np.zeros(DIM)
    for step in range(steps):
        x, y = batch(step)
        w = w - LR * gradient(w, x, y)
    return w


def main():
    p = argparse.ArgumentParser()
    p.add_argument("outdir")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--commit-every", type=int, default=5)
    p.add_argument("--sleep", type=float, default=0.05, help="seconds per step")
    p.add_argument("--raise-at", type=int, default=-1, help="rank 1 raises at this step")
    p.add_argument("--slow-rank", type=int, default=-1,
                   help="this rank sleeps --slow-seconds more before each allreduce")
    p.add_argument("--slow-seconds", type=float, default=0.0)
    p.add_argument("--raise-in-setup", action="store_true",
                   help="rank 0 raises after init(), before the elastic function runs")
    p.add_argument("--check-every", type=int, default=0,
                   help="also call check_host_updates() every N steps")
    args = p.parse_args()

    import horolite as hvd
    from horolite.elastic import ObjectState, run_fn
    hvd.init()
    gen = os.environ.get("HOROLITE_ELASTIC_GENERATION", "-")
    me = f"{gen}.{hvd.rank()}"
    with open(os.path.join(args.outdir, f"pid.{me}"), "w") as f:
        f.write(str(os.getpid()))

    if args.raise_in_setup and hvd.rank() == 0:
        raise TypeError("bad setup argument")
    state = ObjectState(hvd.broadcast_object, hvd.rank, w=np.zeros(DIM), step=0)
    resets = []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])

    @run_fn
    def train(state):
        with open(os.path.join(args.outdir, f"resumed.{me}"), "w") as f:
            f.write(f"{state.step} {len(resets)}")
        log = open(os.path.join(args.outdir, f"steps.{me}"), "a")
        while state.step < args.steps:
            size, rank = hvd.size(), hvd.rank()
            x, y = batch(state.step)
            part = slice(rank * GLOBAL // size, (rank + 1) * GLOBAL // size)
            if rank == 1 and state.step == args.raise_at:
                raise ValueError(f"bad batch at step {state.step}")
            if rank == args.slow_rank:
                time.sleep(args.slow_seconds)
            g = hvd.allreduce(gradient(state.w, x[part], y[part]), op=hvd.Average,
                              name="grad")
            state.w = state.w - LR * g
            state.step += 1
            log.write(f"{gen} {rank} {size} {state.step} {time.time():.6f}\n")
            log.flush()
            time.sleep(args.sleep)
            if state.step % args.commit_every == 0:
                state.commit()
            elif args.check_every and state.step % args.check_every == 0:
                state.check_host_updates()

    train(state)
    np.save(os.path.join(args.outdir, f"final.{hvd.rank()}.npy"), state.w)
    with open(os.path.join(args.outdir, f"done.{hvd.rank()}"), "w") as f:
        f.write(f"{hvd.size()} {gen}")


if __name__ == "__main__":
    sys.exit(main())
