"""The queue between callers and the background thread.

Callers submit entries (request + input + handle); the background thread takes
the new ones each cycle and finds in-flight ones by name when their response
arrives. A name already in flight is refused at submit time.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import numpy as np

from ..errors import DuplicateNameError, prefixed
from ..core.handle import Handle
from ..core.messages import Request
from ..core.wake import Wake

__all__ = ["Entry", "TensorQueue", "Wake", "NATIVE"]


class _Native(threading.local):
    """On the thread that submits for TensorFlow's native enqueue ops (intake.py): when
    the op being submitted ran (monotonic seconds, its `enqueued_ns`), the straggler
    record's measure of when this rank was ready; 0.0: stamp the submit itself."""
    since = 0.0


NATIVE = _Native()


@dataclass(slots=True)
class Entry:
    request: Request
    array: Optional[np.ndarray]
    handle: Handle
    # Alltoall: rows for each destination rank.
    splits: Optional[np.ndarray] = None
    # Device arrays: a CUDA event recorded on the caller's stream at submit (see device.py);
    # the NCCL stream waits on it before reading the array.
    ready: object = None
    # When the background thread took it (within a cycle of the submission: it wakes on
    # submit), and when its response was known; for cache demotion and the timeline.
    taken: float = 0.0
    responded: float = 0.0
    # When its caller submitted it (monotonic; a native op: when the op ran, NATIVE): the
    # straggler record's measure of when this rank was ready (coordination/straggler.py);
    # the background thread may take it later.
    submitted: float = 0.0
    # The array is horolite's own (a packed group in the output pool): reduced in
    # place, it becomes the result.
    owned: bool = False
    # With `owned`: the 1-D pieces whose concatenation is the input, when they were not
    # packed into `array` (which is then still empty): read where they lie.
    parts: Optional[list] = None
    # Whether it may ride in the control round (execution/carried.py); None: not asked yet.
    carry: Optional[bool] = None


class TensorQueue:
    def __init__(self):
        self._lock = threading.Lock()
        self._inflight: Dict[str, Entry] = {}
        self._new: List[Entry] = []
        self._closed: Optional[BaseException] = None
        # After close: answers a submission without the background thread (a quorum
        # result decided before the other ranks left) and returns True, or False.
        self.after_close: Optional[Callable[[Entry], bool]] = None
        self.wake = Wake()
        # Set on the global runtime's queue when native code queues work for it too
        # (runtime/registry.add_intake): its take() submits what it finds, first thing in
        # each take_new on the background thread; pending() says whether more came since;
        # close(error) fails what it holds and what comes later.
        self.intake = None

    def submit(self, entry: Entry, ring: bool = True) -> Handle:
        name = entry.request.name
        if self._closed is not None and self.after_close is not None and \
                self.after_close(entry):
            return entry.handle
        with self._lock:
            if self._closed is not None:
                raise entry.handle.labelled(_naming(self._closed, name))
            if name in self._inflight:
                raise DuplicateNameError(
                    f"tensor '{name}': a collective with this name is already in flight on this "
                    "rank; wait for it (synchronize) or use another name")
            self._inflight[name] = entry
            entry.submitted = NATIVE.since or time.monotonic()
            self._new.append(entry)
        if ring:
            self.wake.set()
        return entry.handle

    def has_inflight(self) -> bool:
        return bool(self._inflight)

    def inflight_count(self) -> int:
        return len(self._inflight)

    def has_new(self) -> bool:
        """Whether anything was submitted since the last take_new."""
        return bool(self._new) or (self.intake is not None and self.intake.pending())

    def take_new(self) -> List[Entry]:
        intake = self.intake
        if intake is not None:
            intake.take()
        with self._lock:
            new, self._new = self._new, []
            self.wake.clear()
        if intake is not None and intake.pending():
            self.wake.set()  # queued natively between take() and clear(): not slept through
        return new

    def get(self, name: str) -> Optional[Entry]:
        with self._lock:
            return self._inflight.get(name)

    def finish(self, name: str) -> Optional[Entry]:
        with self._lock:
            return self._inflight.pop(name, None)

    def finish_all(self, names) -> None:
        """finish() for a fused batch, under one lock."""
        with self._lock:
            pop = self._inflight.pop
            for name in names:
                pop(name, None)

    def close(self, error: BaseException) -> List[Entry]:
        """Refuse new work with `error`; return the entries still pending."""
        with self._lock:
            if self._closed is None:
                self._closed = error
            pending = list(self._inflight.values())
            self._inflight.clear()
            self._new = []
        if self.intake is not None:
            self.intake.close(self._closed)  # what native code queued, and will queue, fails too
        self.wake.set()
        return pending

    @property
    def closed(self) -> Optional[BaseException]:
        return self._closed


def _naming(error: BaseException, name: str) -> BaseException:
    """The queue's closing error, naming the tensor refused (once)."""
    if str(error).startswith("tensor '"):
        return error
    return prefixed(error, f"tensor '{name}'")
