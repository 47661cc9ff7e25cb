"""Processes forked after init() never touch MPI (tests/test_failures.py runs this under mpirun).

    python forks.py OUTDIR

Children made with os.fork, multiprocessing's fork start method and a fork process
pool (a data loader) exit in every way; collectives called in them raise at once; the
parent's job goes on and ends cleanly. Each rank writes OUTDIR/rank.<N> when done.
"""
import faulthandler
import multiprocessing
import os
import sys

import numpy as np

import horolite as hvd

OUTDIR = sys.argv[1]
faulthandler.dump_traceback_later(240, exit=True)  # a hang shows where, then fails
hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()


def collective_in_child():
    """What a child sees: the topology, and an error at once for a collective."""
    assert hvd.rank() == RANK and hvd.size() == SIZE
    try:
        hvd.allreduce(np.ones(3), name="in.child")
    except hvd.HorovodInternalError as e:
        assert "was forked from rank" in str(e) and "tensor 'in.child'" in str(e), str(e)
        return str(e)
    raise AssertionError("a collective in a forked child did not raise")


def fork_and_wait(body):
    pid = os.fork()
    if pid == 0:
        body()  # each body leaves the interpreter its own way
        os._exit(99)  # not reached
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def exit_zero():
    collective_in_child()
    sys.exit(0)


def exit_three():
    sys.exit(3)


def end_of_code():
    collective_in_child()
    raise SystemExit  # as falling off the end of a script does: code 0


def uncaught():
    raise ValueError("child failed")


def load_batch(i):
    """A data loader's work: make a batch (no MPI)."""
    return np.full(4, float(i + RANK))


def mp_child(queue):
    queue.put(collective_in_child())


assert fork_and_wait(exit_zero) == 0
assert fork_and_wait(exit_three) == 3
assert fork_and_wait(end_of_code) == 0
assert fork_and_wait(uncaught) == 1

ctx = multiprocessing.get_context("fork")
queue = ctx.Queue()
proc = ctx.Process(target=mp_child, args=(queue,))
proc.start()
message = queue.get(timeout=30)
proc.join(30)
assert proc.exitcode == 0 and "was forked from rank" in message, (proc.exitcode, message)

with ctx.Pool(2) as pool:
    for step in range(3):
        batches = pool.map(load_batch, range(4))
        got = hvd.allreduce(np.sum(batches, axis=0), op=hvd.Sum, name=f"loader.{step}")
        want = sum(np.sum([np.full(4, float(i + r)) for i in range(4)], axis=0)
                   for r in range(SIZE))
        np.testing.assert_array_equal(got, want)

hvd.barrier()
with open(os.path.join(OUTDIR, f"rank.{RANK}"), "w") as f:
    f.write("ok\n")
