"""The background thread's wake-up: threading.Event's set/is_set/clear/wait on one word.

The word lives in C memory (native/wake.c) so that native code which queues work,
the TensorFlow ops on TensorFlow's own threads, can wake the background thread
without Python or the GIL (`address` and `set_function` are what it calls). The
thread waits in a futex through cffi, which releases the GIL meanwhile.
"""
from __future__ import annotations

from typing import Optional

from .._native import ffi as _ffi, lib as _lib

__all__ = ["Wake"]

_set, _clear, _wait = _lib.hl_wake_set, _lib.hl_wake_clear, _lib.hl_wake_wait
_new = _ffi.new
_WAKE = _ffi.typeof("hl_wake *")


class Wake:
    __slots__ = ("_word",)

    def __init__(self, word=None):
        """word: an `hl_wake *` elsewhere, in memory other processes map too (a rank's
        doorbell on the control board); by default one of this object's own."""
        self._word = _new(_WAKE) if word is None else word  # (new: zeroed, unset)

    def is_set(self) -> bool:
        return bool(self._word.set)

    def set(self) -> None:
        if not self._word.set:
            _set(self._word)

    def clear(self) -> None:
        _clear(self._word)

    def wait(self, timeout: Optional[float] = None) -> bool:
        if self._word.set:
            return True
        return bool(_wait(self._word, -1.0 if timeout is None else max(timeout, 0.0)))

    @property
    def address(self) -> int:
        """The wake word's address, for native code that calls `set_function` on it."""
        return int(_ffi.cast("uintptr_t", self._word))

    @staticmethod
    def set_function() -> int:
        """The address of `void hl_wake_set(void *wake)`."""
        return int(_ffi.cast("uintptr_t", _ffi.addressof(_lib, "hl_wake_set")))
