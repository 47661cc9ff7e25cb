"""One rank's side of a failure scenario (tests/test_failures.py runs it under mpirun).

    python scenario.py CASE OUTDIR

Every rank trains (allreduces in a loop); one rank misbehaves as CASE says. Each rank
writes what it saw to OUTDIR/rank.<N> (the error's class and text) before the error
ends it, so the test can check the message on every rank.
"""
import os
import signal
import sys
import time

import numpy as np

import horolite as hvd

CASE, OUTDIR = sys.argv[1], sys.argv[2]
hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
BAD = SIZE - 1  # the rank that misbehaves


def note(text):
    with open(os.path.join(OUTDIR, f"rank.{RANK}"), "a") as f:
        f.write(text + "\n")


def misbehave(step):
    if CASE == "raise" and step == 3:
        raise RuntimeError("bad batch")
    if CASE == "exit3" and step == 3:
        sys.exit(3)
    if CASE == "exit0" and step == 3:
        sys.exit(0)
    if CASE == "kill9" and step == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    if CASE == "sigterm" and step == 3:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    if CASE == "sleep" and step == 3:
        note("asleep")
        time.sleep(120)  # in user code: the stall inspector sees tensors it never submits
    if CASE == "sigstop" and step == 3:
        # Frozen inside a collective: its peers already wait in this allreduce when it stops.
        handle = hvd.allreduce_async(np.ones(1 << 16), name="frozen")
        time.sleep(0.3)
        note("stopping")
        os.kill(os.getpid(), signal.SIGSTOP)
        handle.result()


def freeze_in_the_data_phase():
    """CASE sigstop-inside: the last rank stops itself once its background thread has
    entered the data phase of tensor 'big' (every rank agreed to reduce it, so the peers
    are in that data phase too, waiting for this rank's data): not 'some time after
    submitting', which may land before or after the transfer."""
    from horolite.api.basics import runtime
    transport = runtime().transport
    for method in ("allreduce", "allreduce_from"):
        real = getattr(transport, method)

        def hooked(*args, _real=real, **kwargs):
            what = kwargs.get("what", args[-1] if args and isinstance(args[-1], str) else "")
            if what == "tensor 'big'":
                note("stopping in the data phase of tensor 'big'")
                os.kill(os.getpid(), signal.SIGSTOP)
            return _real(*args, **kwargs)
        setattr(transport, method, hooked)


def big_step(step):
    """CASE sigstop-inside: every rank reduces 32 MB at step 3; the last one freezes
    inside its data phase (freeze_in_the_data_phase)."""
    if CASE != "sigstop-inside" or step != 3:
        return
    hvd.allreduce(np.ones(1 << 22), name="big")


if CASE == "sigstop-inside" and RANK == BAD:
    freeze_in_the_data_phase()


# What this rank maps from /dev/shm (the MPI library's segments, horolite's window).
with open(f"/proc/{os.getpid()}/maps") as maps, \
        open(os.path.join(OUTDIR, f"shm.{RANK}"), "w") as out:
    out.write("".join(sorted({line[line.index("/dev/shm/"):] for line in maps
                              if "/dev/shm/" in line and "(deleted)" not in line})))

try:
    for step in range(400):
        if RANK == BAD:
            misbehave(step)
        big_step(step)
        hvd.allreduce(np.full(1 << 12, float(step)), name="grad")
        time.sleep(0.01)
    note("finished")
except hvd.HorovodInternalError as e:
    note(f"{type(e).__name__}: {e}")
    raise
