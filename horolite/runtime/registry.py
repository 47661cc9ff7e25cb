"""The runtimes of this process: the global one and one per registered process set.

It sits below both the runtime (a failing runtime dooms its siblings through it) and the API
(init/shutdown fill and empty it, collectives look up the runtime of their set), so neither
has to import the other.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Dict, List, Optional

from ..errors import NotInitializedError

lock = threading.RLock()


@dataclasses.dataclass
class Entry:
    ranks: List[int]
    runtime: object = None  # the set's Runtime on its members, None elsewhere


table: Dict[int, Entry] = {}  # process_set_id -> entry; 0 is the global set
_global = None
# Native producers of work for the global runtime (the TensorFlow enqueue op's intake):
# each is attached to the global runtime's queue while there is one.
_intakes: list = []


def set_global(runtime) -> None:
    global _global
    old, _global = _global, runtime
    for intake in list(_intakes):
        if runtime is not None:
            intake.attach(runtime.queue)
        elif old is not None:
            from ..errors import ShutdownError
            intake.detach(ShutdownError("horolite was shut down before this collective started"))


def add_intake(intake) -> None:
    """intake.attach(queue) now if a global runtime is up, and at every init; intake.detach(error)
    at every shutdown."""
    with lock:
        _intakes.append(intake)
        if _global is not None:
            intake.attach(_global.queue)


def current():
    """The global runtime, or None before init() and after shutdown()."""
    return _global


def global_runtime():
    rt = _global
    if rt is None:
        raise NotInitializedError("horolite is not initialized: call horolite.init() first")
    return rt


def runtimes() -> list:
    """Every set's runtime on this rank, the global one last (no lock: a failing
    background thread calls this while init may hold it)."""
    items = sorted(list(table.items()), key=lambda item: -item[0] if item[0] else 1)
    return [e.runtime for pid, e in items if e.runtime is not None]


def clear() -> list:
    """Forget every set (shutdown); returns their runtimes on this rank, global last."""
    with lock:
        rts = runtimes()
        table.clear()
        return rts


def replace_runtimes(wrap) -> None:
    """After a fork, in the child: each runtime becomes wrap(runtime)."""
    global _global
    with lock:
        for entry in table.values():
            if entry.runtime is not None:
                entry.runtime = wrap(entry.runtime)
        if _global is not None:
            _global = wrap(_global)


def lookup(process_set_id: int) -> Optional[Entry]:
    return table.get(process_set_id)
