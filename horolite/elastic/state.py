"""Horovod's elastic `State` and `ObjectState`, with commits that survive a restart.

Same names, arguments and meaning as Horovod 0.28.1's ``horovod.common.elastic``:
``commit()`` = ``save()`` + ``check_host_updates()``; ``restore()`` undoes what was
not committed; ``sync()`` makes every rank hold rank 0's state. Under horolite-run's
elastic mode ``commit()`` also writes the committed state to host memory
(durable.py), so that the restarted job resumes from it (run.py).
"""
from __future__ import annotations

import queue
import time
from typing import Any, Callable

import numpy as np

from ..api import basics
from ..api.collectives import allreduce
from ..core.ops import Max
from ..errors import HostsUpdatedInterrupt
from . import in_process, protocol
from .durable import CommitStore, Key
from .session import current, log

__all__ = ["State", "ObjectState", "NOT_DURABLE"]

NOT_DURABLE = object()  # what _durable_state() returns for a state it cannot write out
_ADDED, _REMOVED = 1, 2  # Horovod's HostUpdateResult bits


class State:
    """State tracked in memory across workers.

    Args:
        bcast_object: broadcasts a Python object from rank 0 to every rank.
        get_rank: returns this worker's rank.
    """

    def __init__(self, bcast_object: Callable, get_rank: Callable):
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._host_messages: "queue.Queue" = queue.Queue()
        session = current()
        self._last_updated_timestamp = session.seen if session else 0
        self._reset_callbacks = []
        self._commit_key: Key = (0, 0)
        self._warned_not_durable = False
        self.last_commit_seconds = 0.0  # how long the last commit's write to host memory took

    def register_reset_callbacks(self, callbacks) -> None:
        """Functions called after each reset (a restart with another set of ranks), e.g. to
        scale the learning rate with the new `size()`."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self._host_messages = queue.Queue()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp, update_res) -> None:
        self._host_messages.put((timestamp, update_res))

    def commit(self) -> None:
        """Save the state (in memory, and to host memory under horolite-run's elastic mode),
        then check for host changes (HostsUpdatedInterrupt)."""
        self.save()
        self._write_commit()
        if in_process.enabled() and basics.rank() == 0:
            in_process.note_commit()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise HostsUpdatedInterrupt on every rank at once when horolite-run announced a
        change of hosts. Collective: every rank must call it at the same point."""
        newest, update = self._last_updated_timestamp, 0
        while not self._host_messages.empty():
            timestamp, result = self._host_messages.get()
            if timestamp > newest:
                newest, update = timestamp, update | int(result)
        session = current()
        if in_process.enabled():
            self._check_generation()
            return
        if session is not None:
            number, removed_only = protocol.read_update(session.notify)
            if number > newest:
                newest, update = number, update | (_REMOVED if removed_only else _ADDED)
        # Only ranks on the driver's host can read its file: the largest number wins,
        # so that every rank takes the same decision.
        if basics.size() > 1:
            agreed = allreduce(np.array([newest, update], dtype=np.int64), op=Max,
                               name="horolite.elastic.check_host_updates")
            newest, update = int(agreed[0]), int(agreed[1])
        previous, self._last_updated_timestamp = self._last_updated_timestamp, newest
        if newest > previous:
            raise HostsUpdatedInterrupt(update == _REMOVED)

    def _check_generation(self) -> None:
        """A job whose ranks go on in-process: rank 0 asks horolite-run's rendezvous
        whether a newer generation was announced (a worker ready to join, a host gone),
        and every rank moves at this same commit."""
        newer = basics.rank() == 0 and in_process.newest_announced() > in_process.generation()
        if basics.size() > 1:
            newer = bool(allreduce(np.array([int(newer)], dtype=np.int64), op=Max,
                                   name="horolite.elastic.check_generation")[0])
        if newer:
            raise HostsUpdatedInterrupt(False)

    def save(self) -> None:
        """Save the state to host memory."""
        raise NotImplementedError()

    def restore(self) -> None:
        """Restore the last committed state, undoing any uncommitted modifications."""
        raise NotImplementedError()

    def sync(self) -> None:
        """Synchronize the state across workers (rank 0's wins)."""
        raise NotImplementedError()

    def reset(self) -> None:
        """Reset objects and variables after a reset event (before synchronization)."""

    # --- commits that survive the process (horolite) ---
    def _durable_state(self) -> Any:
        """The committed state as picklable objects (NumPy arrays for tensors)."""
        return NOT_DURABLE

    def _load_durable(self, obj: Any) -> None:
        """Make `obj` (from _durable_state on the source rank) the committed state."""
        raise NotImplementedError()

    def _write_commit(self) -> None:
        session = current()
        if session is None:
            return
        obj = self._durable_state()
        if obj is NOT_DURABLE:
            if not self._warned_not_durable:
                self._warned_not_durable = True
                log.warning("rank %d: %s keeps its commits in memory only (it defines no "
                            "_durable_state): after a restart it starts from its initial "
                            "values", basics.rank(), type(self).__name__)
            return
        started = time.perf_counter()
        key = (self._commit_key[0] + 1, session.generation)
        CommitStore(session.commit_dir(), basics.rank()).write(key, obj)
        self._commit_key = key
        self.last_commit_seconds = time.perf_counter() - started


class ObjectState(State):
    """State of plain Python objects, given as keyword arguments and kept as attributes.

    Args:
        bcast_object: broadcasts the state dictionary from rank 0.
        get_rank: returns this worker's rank.
        kwargs: the properties to track (picklable).
    """

    def __init__(self, bcast_object: Callable, get_rank: Callable, **kwargs):
        self._bcast_object = bcast_object
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {attr: getattr(self, attr) for attr in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, value)

    def _durable_state(self) -> Any:
        return {"objects": self._saved_state}

    def _load_durable(self, obj: Any) -> None:
        self._saved_state = dict(obj["objects"])
        self._set_attrs()


