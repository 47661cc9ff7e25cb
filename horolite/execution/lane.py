"""The exchange lane: agreed allreduces run on a thread of their own, in order.

Across hosts a bucket's exchange waits on the network for tens of milliseconds.
Run on the background thread, it holds the next cycle back: the bucket behind it
is not even seen as ready until it ends, then costs a control round before it
leaves. With the lane, the background thread hands an agreed list of allreduces
over and goes on to the next cycle, so the next bucket is agreed while this one
is in flight and starts the moment the link is free, and a step's buckets go out
as one stream.

Every rank hands the lane the same lists in the same order (they are agreed), and
the lane runs them one after another: every rank makes the same transport calls
in the same order, as on the background thread. The lane uses only the data
plane (the transport's data communicators and its own waiter), the background
thread only the control plane, so they never share a communicator or a request.
Over horolite's TCP connections they share each peer's sockets and the mesh's one
condition: the control plane's messages take the express connection (tcp_link.py),
so they do not queue behind the lane's pieces.
Anything else (broadcasts, gathers, quorum allreduces, errors, joins) first waits
for the lane to empty and then runs on the background thread, as before.

An exception in the lane (a peer's failure heard in a wait, a lost link, a
stall, a bug) stops it; the background thread raises it at its next look
(`check`), from its own waits too, and ends the job as if it had met it itself.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Optional, Sequence

from ..core.messages import Kind, Response
from ..core.ops import ReduceOp

__all__ = ["ExchangeLane", "lane_wanted", "pipelines"]

_log = logging.getLogger("horolite.execution.lane")

# Agreed lists waiting in the lane at most: the background thread waits beyond that
# (a step's buckets are a handful; more would only hold memory).
DEPTH = 8


def lane_wanted(setting: str, hosts: int, thread_multiple: bool) -> bool:
    """HOROLITE_EXCHANGE_PIPELINE: `auto` where the ranks span hosts (the network is
    what an exchange waits on; on one host it waits on the cores backprop needs), `1`
    always, `0` never. Two threads call MPI at once: THREAD_MULTIPLE only."""
    value = str(setting).strip().lower()
    if value not in ("auto", "0", "1"):
        raise ValueError(f"HOROLITE_EXCHANGE_PIPELINE={setting!r}: expected auto, 0 or 1")
    if not thread_multiple:
        return False
    return value == "1" or (value == "auto" and hosts > 1)


def pipelines(responses: Sequence[Response]) -> bool:
    """Whether the lane may run this agreed list: host allreduces only, each of all
    ranks' own tensors (no error, no quorum, no Adasum, no joined rank's zeros)."""
    for resp in responses:
        if (resp.kind != Kind.ALLREDUCE or resp.device != "cpu" or resp.error is not None
                or resp.contributors or resp.joined or resp.op == ReduceOp.ADASUM):
            return False
    return True


class ExchangeLane:
    def __init__(self, executor, wake, name: str):
        """executor: execution.executor.Executor, run here; wake: the background
        thread's wake-up, rung when the lane fails."""
        self._executor = executor
        self._wake = wake
        self._jobs = collections.deque()
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self.error: Optional[BaseException] = None
        self._raised = False
        self.holding = 0  # entries handed over whose batch has not run: no cycle need wait on them
        self.reduced = 0  # bytes allreduced since the background thread last took them
        # Agreed lists the lane took (tests read it): counted as one starts, so a caller
        # whose handle that list completes always sees it counted.
        self.lists = 0
        # Lists handed over while an earlier one was still running: agreed in flight.
        self.handed_while_busy = 0
        # Lists already waiting when the one before them ended, so started straight
        # after it on this thread, with no cycle between; the last one's gap (seconds)
        # from that end to its start. Tests read both: the next bucket follows at once.
        self.followed = 0
        self.follow_gap: Optional[float] = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # ---- background thread ----
    def submit(self, responses, entries) -> None:
        """Hand over a list agreed this cycle, with this cycle's fusion threshold: by the
        time the lane runs it, this rank may have adopted another (autotune), at another
        list than its peers, and the ranks must fuse alike."""
        threshold = self._executor.fusion_threshold
        with self._cond:
            while len(self._jobs) >= DEPTH and self.error is None and not self._closed:
                self._cond.wait(0.05)
            self.check()
            self.handed_while_busy += self._busy
            self._jobs.append((list(responses), list(entries), threshold))
            self.holding += len(entries)
            self._cond.notify_all()

    def drain(self) -> None:
        """Return once every list handed over has run (raises the lane's error)."""
        with self._cond:
            while (self._jobs or self._busy) and self.error is None and not self._closed:
                self._cond.wait(0.05)
        self.check()

    def check(self) -> None:
        """Raise the lane's exception, once, in the calling (background) thread."""
        error = self.error
        if error is not None and not self._raised:
            self._raised = True
            raise error

    @property
    def running(self) -> bool:
        """Whether a list is being run now."""
        return self._busy

    def leaves_waiting(self, queue) -> bool:
        """Whether `queue` holds work beyond the lane's: what a cycle must move on.
        While the lane alone has work, this rank has no news for a control round, and
        rests between cycles as an idle rank does, rather than spend the cores that
        backprop and the exchange need on empty rounds. (`holding` drops batch by batch,
        as entries leave the queue: else work that came meanwhile would look idle.)"""
        return queue.inflight_count() > self.holding

    def take_reduced(self) -> int:
        with self._cond:
            reduced, self.reduced = self.reduced, 0
        return reduced

    def close(self) -> None:
        """Stop taking lists (what is queued is dropped: its handles were failed or done)."""
        with self._cond:
            self._closed = True
            self._jobs.clear()
            self._cond.notify_all()

    # ---- the lane's thread ----
    def _batch_done(self, count: int) -> None:
        """A batch's entries left the queue. Work beyond the lane's that looked idle
        until now (the background thread may have rested on it) rings the wake-up."""
        queue = self._executor.queue
        looked_idle = not self.leaves_waiting(queue)
        with self._cond:
            self.holding -= count
        if looked_idle and self.leaves_waiting(queue):
            self._wake.set()

    def _loop(self) -> None:
        ended = None  # when the last list ended, if the next one was waiting by then
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                responses, entries, threshold = self._jobs.popleft()
                self._busy = True
                self.lists += 1
            if ended is not None:
                self.follow_gap = time.monotonic() - ended
                self.followed += 1
            try:
                reduced = self._executor.run(responses, entries, threshold, self._batch_done)
            except BaseException as e:  # raised again on the background thread
                if not self._closed:
                    _log.debug("rank %d: exchange lane stopped: %r", self._executor.rank, e)
                with self._cond:
                    self.error = e
                    self._busy = False
                    self._jobs.clear()
                    self.holding = 0
                    self._cond.notify_all()
                self._wake.set()
                return
            ended = time.monotonic()
            with self._cond:
                self._busy = False
                self.reduced += reduced
                if not self._jobs:
                    ended = None
                self._cond.notify_all()
