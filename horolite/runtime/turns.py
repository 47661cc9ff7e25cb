"""Who runs the runtime's cycles: the background thread, or a caller that waits.

A caller that submits and then waits for its result (a synchronous allreduce, a
synchronize) would otherwise pay two hand-offs between threads: waking the
background thread to run the cycle, and waking the caller with the result. Each
costs a futex wake and a turn of the GIL, tens of microseconds, more than the
collective itself on one host. So a caller about to wait runs the cycles itself,
while the background thread is not in one, until its own result is there. The
cycles are the same code whoever runs them, one at a time (the turn lock), so
every rank still goes through the same rounds in the same order.

The background thread stays the owner of the runtime's life: what a caller's
cycle raises, or its decision to stop, is handed to it, and it ends or closes
the runtime exactly as if it had met them itself. After a caller's turn it runs
a cycle only when something needs one (work queued or in flight, shutdown, or a
peer waiting in a round this rank has not entered), so it does not enter a round
that the caller's next turn would have to wait behind.

Only runtimes whose control exchange is the shared-memory board take callers'
turns: there a wait sleeps in a futex that the last rank into the round wakes.
"""
from __future__ import annotations

import threading
from typing import Callable, Optional

from ..errors import HorovodInternalError

__all__ = ["Turns"]


class Turns:
    def __init__(self, cycle: Callable[[], bool], after_cycle: Callable[[], None],
                 wanted: Callable[[bool], bool], wake, rank: int):
        self._cycle, self._after, self._wanted, self._wake = cycle, after_cycle, wanted, wake
        self.rank = rank
        self._lock = threading.Lock()
        self._handed: Optional[BaseException] = None  # raised in a caller's cycle
        self._stopped = False  # a caller's cycle agreed to stop
        self._caller_cycles = 0
        self._seen = 0  # caller cycles the background thread knows of
        self.caller_cycles_run = 0  # (tests and benchmarks read it)

    def background(self) -> bool:
        """The background thread's cycle, under the turn; False when the runtime stops.
        Raises what a caller's cycle raised."""
        with self._lock:
            if self._handed is not None:
                handed, self._handed = self._handed, None
                raise handed
            if self._stopped:
                return False
            if self._seen != self._caller_cycles:
                self._seen = self._caller_cycles
                if not self._wanted():
                    return True  # a caller ran the cycles meanwhile: nothing left to do
            alive = self._cycle()
            self._after()
            return alive

    def caller(self, handle) -> None:
        """Run cycles on the calling thread until `handle` is done, if no cycle is
        running now (else return at once: the background thread completes it)."""
        if not self._lock.acquire(blocking=False):
            self._wake.set()  # its submit may have left the background thread asleep
            return
        try:
            while not handle._done and self._handed is None and not self._stopped:
                alive = self._cycle()
                self._caller_cycles += 1
                self.caller_cycles_run += 1
                self._after()
                if not alive:
                    self._stopped = True
        except KeyboardInterrupt:
            # Half a cycle cannot be resumed: the runtime ends, on every rank, with this.
            self._handed = HorovodInternalError(
                f"rank {self.rank}: interrupted inside a collective's cycle")
            raise
        except BaseException as e:  # noqa: BLE001 - the background thread ends the runtime with it
            self._handed = e
        finally:
            self._lock.release()
            # (A peer that needs this rank in a round rings it, which wakes the
            # background thread: that one looks for waiting peers itself.)
            if self._handed is not None or self._stopped or self._wanted(False):
                self._wake.set()
