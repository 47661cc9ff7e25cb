"""The exchange lane with the real executor over a recording transport, one process.

The lane runs an agreed list later than the cycle that agreed it: what it plans with
and what it says is still in flight must be the list's, not whatever this rank
adopted or finished meanwhile (execution/lane.py).
"""
import threading

import numpy as np

from horolite.coordination.tensor_queue import Entry, TensorQueue
from horolite.core.handle import Handle
from horolite.core.messages import Kind, Request, Response
from horolite.core.ops import ReduceOp
from horolite.core.timeline import NullTimeline
from horolite.execution.executor import Executor
from horolite.execution.lane import ExchangeLane


class RecordingTransport:
    """Two ranks' worth of sizes, one process: records each allreduce's element count
    (what a peer would receive) and holds the calls listed in `hold` until released."""
    rank, size, shared_memory, reads_parts = 0, 2, None, False

    def __init__(self, hold=()):
        self.sizes, self.hold = [], set(hold)
        self.entered = threading.Event()  # a held call began
        self.release = threading.Event()

    def doing(self, what):
        pass

    def _call(self, buf, postscale):
        self.sizes.append(buf.size)
        if len(self.sizes) - 1 in self.hold:
            self.entered.set()
            assert self.release.wait(10), "the test never released the transport"
        buf *= 2 * postscale  # the other rank holds the same values

    def allreduce(self, buf, op, postscale, what=""):
        self._call(buf, postscale)

    def allreduce_from(self, src, dst, op, postscale, what=""):
        dst[...] = src
        self._call(dst, postscale)


def setup(threshold, hold):
    transport = RecordingTransport(hold)
    queue = TensorQueue()
    executor = Executor(transport, queue, threshold, NullTimeline())
    return transport, queue, executor, ExchangeLane(executor, queue.wake, "test-lane")


def submitted(queue, name, n, dtype=np.float32):
    """A queued allreduce of n ones, and its agreed response."""
    req = Request(name=name, kind=Kind.ALLREDUCE, dtype=np.dtype(dtype).name, shape=(n,),
                  op=ReduceOp.SUM)
    entry = Entry(req, np.ones(n, dtype), Handle(name))
    queue.submit(entry)
    return Response(kind=Kind.ALLREDUCE, name=name, dtype=req.dtype, shape=(n,),
                    op=ReduceOp.SUM), entry


def test_a_list_is_fused_with_the_threshold_it_was_agreed_with():
    transport, queue, executor, lane = setup(1 << 20, hold={0})
    try:
        big = submitted(queue, "big", 1 << 16)
        lane.submit([big[0]], [big[1]])
        assert transport.entered.wait(10)  # the lane is busy with it
        (r1, e1), (r2, e2) = submitted(queue, "t1", 1024), submitted(queue, "t2", 1024)
        lane.submit([r1, r2], [e1, e2])  # agreed at 1 MiB: one fused allreduce of 8 KiB
        executor.set_fusion_threshold(6000)  # adopted at the next cycle, before it runs
        transport.release.set()
        lane.drain()
        assert transport.sizes == [1 << 16, 2048]  # not [.., 1024, 1024], as a peer that
        for entry in (e1, e2):                     # adopted it later would run it
            np.testing.assert_array_equal(entry.handle.result(10), np.full(1024, 2, np.float32))
        assert lane.followed == 1 and lane.follow_gap is not None
    finally:
        lane.close()


def test_the_lane_holds_no_more_than_what_it_has_not_yet_finished():
    # Two batches (float32 and float64 do not fuse): the second is held in the transport.
    transport, queue, executor, lane = setup(1 << 20, hold={1})
    try:
        (r1, e1), (r2, e2) = submitted(queue, "a", 100), submitted(queue, "b", 100, np.float64)
        lane.submit([r1, r2], [e1, e2])
        assert transport.entered.wait(10)  # the first batch is done: "a" left the queue
        assert e1.handle.done() and not lane.leaves_waiting(queue)
        submitted(queue, "next", 10)  # the next bucket, taken in a cycle meanwhile
        assert lane.leaves_waiting(queue), "new work beyond the lane's looked idle"
        transport.release.set()
        lane.drain()
        assert lane.holding == 0 and lane.followed == 0
    finally:
        lane.close()


def test_work_that_looked_idle_rings_the_background_thread_when_a_batch_ends():
    transport, queue, executor, lane = setup(1 << 20, hold={0})
    wake = queue.wake  # the background thread's (the runtime hands the lane the same)
    try:
        (r1, e1), (r2, e2) = submitted(queue, "a", 100), submitted(queue, "b", 100, np.float64)
        lane.submit([r1, r2], [e1, e2])
        assert transport.entered.wait(10)
        submitted(queue, "late", 10)  # came while "a" was still on the wire
        wake.clear()
        transport.release.set()
        lane.drain()
        assert wake.is_set() and lane.holding == 0
    finally:
        lane.close()


def test_a_list_waiting_when_the_last_one_ends_follows_it_on_the_lane():
    transport, queue, executor, lane = setup(1 << 20, hold={0})
    try:
        first = submitted(queue, "first", 1000)
        lane.submit([first[0]], [first[1]])
        assert transport.entered.wait(10)
        second = submitted(queue, "second", 1000)
        lane.submit([second[0]], [second[1]])
        assert lane.handed_while_busy == 1
        transport.release.set()
        lane.drain()
        third = submitted(queue, "third", 1000)  # handed to an idle lane: waits for nothing
        lane.submit([third[0]], [third[1]])
        lane.drain()
        assert (lane.lists, lane.followed) == (3, 1)
        assert 0 <= lane.follow_gap < 1.0
    finally:
        lane.close()
