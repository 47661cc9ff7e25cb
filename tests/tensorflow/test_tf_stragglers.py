"""Rank side: the straggler record (docs/stragglers.md) with TensorFlow's native enqueue op.

A rank counts as ready when its op ran (the op's own time, `enqueued_ns`), not when the
background thread took the item: here the slow rank's background thread is held in a
long control round while its op runs, as a slow control plane would hold it, and the
record must still say how late the op was. Run by tests/test_matrix_tensorflow.py under
mpirun -np 1..4.
"""
import os
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import pytest
import tensorflow as tf

import horolite.tensorflow as hvd
from horolite.runtime import registry

hvd.init()
R, N = hvd.rank(), hvd.size()
SLOW = N - 1
DELAY = 0.1  # seconds the slow rank's op runs after the others'
HOLD = 0.1  # and its background thread stays in a control round that long after it


def settle(timeout=10.0):
    """Until every round this rank noted has reached rank 0 and the report is back."""
    record = registry.global_runtime().stragglers
    time.sleep(0.05)
    deadline = time.monotonic() + timeout
    while record.ages.count:
        assert time.monotonic() < deadline, "the straggler record was never exchanged"
        time.sleep(0.02)


def totals():
    return {r: v["total"] for r, v in hvd.straggler_report()["ranks"].items()}


@pytest.mark.skipif(N < 2, reason="needs a straggler: at least two ranks")
def test_a_late_op_counts_from_when_it_ran_though_the_background_thread_was_held():
    rt = registry.global_runtime()
    transport, until = rt.transport, [0.0]
    control_or = transport.control_or

    def held(*args, **kwargs):  # the slow rank's background thread: a long round
        if threading.current_thread() is rt._thread:
            wait = until[0] - time.monotonic()
            if wait > 0:
                time.sleep(wait)
        return control_or(*args, **kwargs)

    step = tf.function(lambda x: hvd.allreduce(x, name="straggler.step", op=hvd.Sum))
    x = tf.constant(np.full(4, float(R), np.float32))
    assert step(x).numpy().tolist() == [float(sum(range(N)))] * 4  # traced before timing
    steps = 15
    settle()
    before = totals()
    if R == SLOW:
        transport.control_or = held
    try:
        for _ in range(steps):
            if R == SLOW:
                until[0] = time.monotonic() + DELAY + HOLD
                time.sleep(DELAY)
            step(x)
    finally:
        if R == SLOW:
            del transport.control_or  # the class's method again
    settle()
    after = totals()
    last = {r: after[r]["last"] - before[r]["last"] for r in after}
    wait = {r: after[r]["wait_seconds"] - before[r]["wait_seconds"] for r in after}
    assert last[SLOW] >= 0.8 * steps, (last, wait)
    measured = wait[SLOW] / last[SLOW]
    assert abs(measured - DELAY) <= 0.2 * DELAY, (measured, last, wait)
