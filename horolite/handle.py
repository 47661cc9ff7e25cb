"""The handle a caller holds for one collective: a tiny future.

Only the background thread completes a handle, with exactly one of a result or
an exception (the pattern of concurrent.futures).
"""
from __future__ import annotations

import threading
from typing import Any, Callable, List, Optional

__all__ = ["Handle"]


class Handle:
    __slots__ = ("name", "_event", "_result", "_exception", "_callbacks", "_lock", "_transform")

    def __init__(self, name: str, transform: Optional[Callable[[Any], Any]] = None):
        self.name = name
        self._event = threading.Event()
        self._result = None
        self._exception: Optional[BaseException] = None
        self._callbacks: List[Callable[["Handle"], None]] = []
        self._lock = threading.Lock()
        self._transform = transform

    def done(self) -> bool:
        return self._event.is_set()

    def result(self, timeout: Optional[float] = None):
        if not self._event.wait(timeout):
            raise TimeoutError(f"collective {self.name!r} did not complete within {timeout} s")
        if self._exception is not None:
            raise self._exception
        return self._result

    def exception(self) -> Optional[BaseException]:
        self._event.wait()
        return self._exception

    def add_done_callback(self, fn: Callable[["Handle"], None]) -> None:
        """Call fn(handle) once done (at once if already done)."""
        with self._lock:
            if not self._event.is_set():
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

    def _set_exception(self, exc: BaseException) -> None:
        self._finish(None, exc)

    def _finish(self, value, exc) -> None:
        with self._lock:
            if self._event.is_set():
                return
            self._result, self._exception = value, exc
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn(self)
            except Exception:  # a callback's failure must not kill the background thread
                import logging
                logging.getLogger("horolite").exception("done callback of %r failed", self.name)

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<horolite.Handle {self.name!r} {state}>"
