"""Horovod's process-set names for the TensorFlow API (the sets themselves are the
core's: horolite/api/process_sets.py), and the few questions the adapters ask of a set."""
from __future__ import annotations

from typing import Optional, Sequence

import tensorflow as tf

import horolite as _core
from horolite.api.process_sets import (ProcessSet, add_process_set, global_process_set,
                                       remove_process_set, runtime_for)
from horolite.errors import InvalidCollectiveError

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
           "ProcessSetError", "check_process_set", "check_init_process_sets", "set_size",
           "set_rank", "reduces_here"]


class ProcessSetError(tf.errors.InvalidArgumentError, InvalidCollectiveError):
    """A collective on a set this rank cannot use. Horovod's op fails with
    InvalidArgumentError for a rank outside the set, and its allreduce with ValueError
    (from ``process_set.size()``) for a set never registered: this is both, and
    horolite's InvalidCollectiveError, so every ``except`` clause written for either
    catches it. Built as TensorFlow's errors are, ``ProcessSetError(None, None, message)``
    (so a tf.function re-raises it as it is)."""


def check_process_set(process_set, what: str) -> None:
    """A clear error now (not when the op runs; in a graph, when the op is built) for a
    set this rank cannot use: not a ProcessSet, not registered, or this rank not a
    member. The error is a ProcessSetError."""
    try:
        runtime_for(process_set, what)
    except InvalidCollectiveError as e:
        raise ProcessSetError(None, None, str(e)) from None


def check_init_process_sets(process_sets: Optional[Sequence]) -> None:
    """Kept for callers of the old name: init() checks its process_sets itself."""


def _is_global(process_set) -> bool:
    return process_set is None or process_set is global_process_set or \
        getattr(process_set, "process_set_id", None) == 0


def set_size(process_set) -> int:
    """The number of ranks a collective on `process_set` runs over."""
    return _core.size() if _is_global(process_set) else runtime_for(process_set, "size").size


def set_rank(process_set) -> int:
    """This rank's position in `process_set` (the order of gathered results)."""
    return _core.rank() if _is_global(process_set) else runtime_for(process_set, "rank").rank


def reduces_here(process_set) -> bool:
    """Horovod's rule for gradient reduction on a set: only when this rank is in it and
    it has more than one rank (else the gradients stay local)."""
    if _is_global(process_set):
        return True
    return bool(process_set.included()) and (process_set.size() or 0) > 1
