"""The handle a caller holds for one collective: a tiny future.

Only the background thread completes a handle, with exactly one of a result or
an exception (the pattern of concurrent.futures).
"""
from __future__ import annotations

import threading
from _thread import allocate_lock
from typing import Any, Callable, List, Optional

__all__ = ["Handle"]

# Guards completion against add_done_callback; held for a few instructions only.
_callback_lock = threading.Lock()


class Handle:
    # A plain lock, held until completion, is the cheapest thing a waiter can block
    # on (threading.Event builds a Condition per handle); it is made only when someone
    # must wait, since most handles of a step are done by the time they are asked.
    __slots__ = ("name", "_done", "_gate", "_result", "_exception", "_callbacks", "_transform",
                 "first_dims", "contributors", "helper")

    def __init__(self, name: str, transform: Optional[Callable[[Any], Any]] = None):
        self.name = name
        self._done = False
        self._gate = None
        self._result = None
        self._exception: Optional[BaseException] = None
        self._callbacks: Optional[List[Callable[["Handle"], None]]] = None
        self._transform = transform
        # An allgather's: every rank's first dimension, in rank order (a list of
        # them for a grouped allgather). Its gradient needs them to find this rank's rows.
        self.first_dims = None
        # A quorum allreduce's: the ranks whose inputs were reduced (quorum.py).
        self.contributors = None
        # Set by a runtime that lets a waiting caller run its cycles (runtime/turns.py):
        # called with this handle before a wait without timeout blocks.
        self.helper = None

    def done(self) -> bool:
        return self._done

    def _wait(self, timeout: Optional[float]) -> bool:
        if self._done:
            return True
        if timeout is None and self.helper is not None:
            self.helper(self)
            if self._done:
                return True
        with _callback_lock:
            if self._done:
                return True
            gate = self._gate
            if gate is None:
                gate = self._gate = allocate_lock()
                gate.acquire()
        if not gate.acquire(timeout=-1 if timeout is None else max(timeout, 0)):
            return False
        gate.release()  # let any other waiter through
        return True

    def result(self, timeout: Optional[float] = None):
        if not self._wait(timeout):
            raise TimeoutError(f"collective {self.name!r} did not complete within {timeout} s")
        if self._exception is not None:
            raise self._exception
        return self._result

    def exception(self) -> Optional[BaseException]:
        self._wait(None)
        return self._exception

    def add_done_callback(self, fn: Callable[["Handle"], None]) -> None:
        """Call fn(handle) once done (at once if already done)."""
        with _callback_lock:
            if not self._done:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        fn(self)

    # Called by the background thread only.
    def _set_result(self, value) -> None:
        if self._transform is not None:
            try:
                value = self._transform(value)
            except BaseException as e:  # a bug in a transform must still complete the handle
                self._set_exception(e)
                return
        self._finish(value, None)

    @staticmethod
    def set_results(handles: List["Handle"], values: List[Any]) -> None:
        """_set_result of each handle of a fused batch, under one lock: hundreds of
        small tensors complete at once, on the background thread's time."""
        rest = []
        with _callback_lock:
            for handle, value in zip(handles, values):
                if handle._transform is None and handle._callbacks is None and not handle._done:
                    handle._result = value
                    handle._done = True
                    if handle._gate is not None:
                        handle._gate.release()
                else:
                    rest.append((handle, value))
        for handle, value in rest:
            handle._set_result(value)

    def labelled(self, exc: BaseException) -> BaseException:
        """`exc` as this handle's errors read (a process set's name its set)."""
        return exc

    def _set_exception(self, exc: BaseException) -> None:
        self._finish(None, exc)

    def _finish(self, value, exc) -> None:
        with _callback_lock:
            if self._done:
                return
            self._result, self._exception = value, exc
            self._done = True
            callbacks, self._callbacks = self._callbacks, None
            gate = self._gate
        if gate is not None:
            gate.release()
        for fn in callbacks or ():
            try:
                fn(self)
            except Exception:  # a callback's failure must not kill the background thread
                import logging
                logging.getLogger("horolite").exception("done callback of %r failed", self.name)

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<horolite.Handle {self.name!r} {state}>"
