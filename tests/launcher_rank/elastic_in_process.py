"""An elastic job without MPI whose survivors go on in their running processes.

The same least-squares training as elastic_train.py (its result does not depend on how
many ranks run it), started once by ``horolite-run --gloo --min-np``. Per worker
(HOROLITE_ELASTIC_WORKER, the same name across generations) it writes into OUTDIR:
``pid.<worker>`` (to kill), ``steps.<worker>`` (``<generation> <rank> <size> <step>
<time>`` per step), ``resets.<worker>`` (``<generation> <size> <pid>`` per reset),
``local.<worker>`` (its ``hvd.local_rank()`` each time training starts or resumes) and
at the end ``final.<worker>.npy`` and ``final_step.<worker>``.
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from elastic_train import DIM, GLOBAL, LR, batch, gradient  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("outdir")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--commit-every", type=int, default=3)
    p.add_argument("--sleep", type=float, default=0.05, help="seconds per step")
    p.add_argument("--raise-at", type=int, default=-1, help="rank 1 raises at this step")
    p.add_argument("--typo-at-setup", action="store_true",
                   help="every rank raises AttributeError after hvd.init(), outside run")
    p.add_argument("--raise-after-train", action="store_true",
                   help="rank 1 raises ValueError after train() returns")
    p.add_argument("--until-file", help="every rank stops at the first step after it exists")
    p.add_argument("--fail-first-join", metavar="FILE",
                   help="the first worker started to join fails at once (it creates FILE)")
    args = p.parse_args()
    if args.fail_first_join and os.environ.get("HOROLITE_ELASTIC_JOIN"):
        try:
            open(args.fail_first_join, "x").close()
            sys.exit("this worker cannot start here")
        except FileExistsError:
            pass

    import horolite as hvd
    from horolite.elastic import ObjectState, run_fn
    from horolite.elastic import in_process
    hvd.init()
    me = os.environ["HOROLITE_ELASTIC_WORKER"]
    if args.typo_at_setup:
        hvd.brodcast_object  # (a typo: AttributeError)
    out = lambda name: os.path.join(args.outdir, f"{name}.{me}")  # noqa: E731
    with open(out("pid"), "w") as f:
        f.write(str(os.getpid()))

    state = ObjectState(hvd.broadcast_object, hvd.rank, w=np.zeros(DIM), step=0)

    def on_reset():
        with open(out("resets"), "a") as f:
            f.write(f"{in_process.generation()} {hvd.size()} {os.getpid()}\n")
    state.register_reset_callbacks([on_reset])

    @run_fn
    def train(state):
        log = open(out("steps"), "a")
        with open(out("local"), "a") as f:
            f.write(f"{hvd.local_rank()}\n")
        while state.step < args.steps:
            size, rank = hvd.size(), hvd.rank()
            x, y = batch(state.step)
            part = slice(rank * GLOBAL // size, (rank + 1) * GLOBAL // size)
            if rank == 1 and state.step == args.raise_at:
                raise ValueError(f"bad batch at step {state.step}")
            g = hvd.allreduce(gradient(state.w, x[part], y[part]), op=hvd.Average, name="grad")
            state.w = state.w - LR * g
            state.step += 1
            log.write(f"{in_process.generation()} {rank} {size} {state.step} {time.time():.6f}\n")
            log.flush()
            time.sleep(args.sleep)
            if state.step % args.commit_every == 0:
                state.commit()
            if args.until_file:
                seen = np.array([float(os.path.exists(args.until_file))])
                if hvd.allreduce(seen, op=hvd.Max, name="until")[0]:
                    break

    train(state)
    if args.raise_after_train and hvd.rank() == 1:
        raise ValueError(f"no checkpoint directory after step {state.step}")
    np.save(out("final") + ".npy", state.w)
    with open(out("final_step"), "w") as f:
        f.write(str(state.step))


if __name__ == "__main__":
    sys.exit(main())
