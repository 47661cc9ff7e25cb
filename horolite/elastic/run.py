"""``hvd.elastic.run``: Horovod's retry loop, made of restarts of the whole job.

Over MPI the ranks are a fixed world, so a lost rank or a new host ends the job and
horolite-run starts it again (launcher/elastic.py). This wrapper is the rank's side:

- at the start of a restarted job, every rank says which commit its host holds;
  the lowest rank holding the newest one broadcasts it, and every rank restores it
  (then ``state.on_reset()``, as after Horovod's reset, then ``state.sync()``);
- HostsUpdatedInterrupt (agreed by every rank in ``check_host_updates``): the
  current state is written out and every rank leaves, asking for a restart;
- an error of the runtime (a lost peer, a stall): ``state.restore()`` and the process
  ends; horolite-run restarts the job;
- any other exception is the training code's own (in `run`, or uncaught anywhere in the
  script once horolite is imported): it is named to horolite-run, which ends the job
  with it (Horovod instead blacklists the host and retries).
"""
from __future__ import annotations

import functools
import os
import sys
import time
from typing import Callable, Optional

import numpy as np

from ..api import basics
from ..api.collectives import allgather, broadcast
from ..errors import HorovodInternalError, HostsUpdatedInterrupt, ShutdownError
from ..failure.channel import caused_by_peer, describe_exception, launcher_marker
from ..failure.links import LinkLost
from ..world import generations
from ..world.rendezvous import RendezvousError
from ..world.sockets import Superseded
from ..world.sockets_comm import SocketWorldError
from . import in_process, protocol
from .durable import CommitStore, decode
from .session import current, log
from .state import State

__all__ = ["run_fn", "resume", "is_runtime_failure"]

_resumed = False
# Errors of the runtime's own connections and of the job's rendezvous: never the training
# code's (a rank that was stopped and evicted sees its peers' FENCE as LinkLost).
_RUNTIME_ERRORS = (ShutdownError, HostsUpdatedInterrupt, LinkLost, SocketWorldError,
                   RendezvousError, Superseded, generations.LeftOut)


def is_runtime_failure(exc: BaseException) -> bool:
    """True when `exc` says the job cannot go on (a peer lost, a stall, the runtime ended,
    a connection or the rendezvous gone, or, in a job whose ranks recover in-process, a
    world that has moved on to a newer generation), False for an error of the training
    code itself (its own exceptions, bad arguments). The one place that tells them apart:
    the launchers' drivers end a job for the second kind only."""
    if caused_by_peer(exc) or isinstance(exc, _RUNTIME_ERRORS):
        return True
    rt = basics._current_runtime()
    if rt is not None:  # a framework's error (tf.errors.*) around the runtime's own
        failures = getattr(rt, "failures", None)
        if failures is not None and failures.heard is not None:
            return True  # another rank had failed first
        doomed = getattr(rt, "doomed", None)
        if doomed is not None and (caused_by_peer(doomed) or isinstance(doomed, _RUNTIME_ERRORS)):
            return True  # not this rank's own exception: a stall, a peer gone
    if isinstance(exc, HorovodInternalError) and not isinstance(exc, ValueError):
        return True
    return in_process.enabled() and in_process.world_moved_on()


def resume(state: State) -> Optional[tuple]:
    """After a restart: make every rank hold the newest commit any rank's host kept.
    Returns its key, or None when no rank has one. Collective."""
    session = current()
    if session is None:
        return None
    started = time.perf_counter()
    store = CommitStore(session.commit_dir(), basics.rank())
    key, path = store.newest()
    keys = allgather(np.array([[key[0], key[1]]], dtype=np.int64),
                     name="horolite.elastic.resume.keys").reshape(-1, 2)
    best = max(tuple(int(v) for v in row) for row in keys)
    if best == (0, 0):
        return None
    source = next(r for r, row in enumerate(keys) if tuple(int(v) for v in row) == best)
    data = np.zeros(0, dtype=np.uint8)
    if basics.rank() == source:
        with open(path, "rb") as f:
            data = np.frombuffer(f.read(), dtype=np.uint8)
    length = broadcast(np.array([data.size], dtype=np.int64), source,
                       name="horolite.elastic.resume.length")
    if basics.rank() != source:
        data = np.empty(int(length[0]), dtype=np.uint8)
    data = broadcast(data, source, name="horolite.elastic.resume.state")
    found, obj = decode(data)
    state._load_durable(obj)
    state._commit_key = found
    log.info("rank %d: resumed from commit %d (made in generation %d) held by rank %d, "
             "%.1f MB in %.2f s", basics.rank(), found[0], found[1], source,
             data.size / 1e6, time.perf_counter() - started)
    return found


def _leave_for_reset(state: State) -> None:
    """Every rank agreed on a host update: keep the current state, then end the process
    so that horolite-run restarts the job on the new hosts."""
    state.save()
    state._write_commit()
    launcher_marker(protocol.MARKER_KIND, event=protocol.RESET, rank=basics.rank())
    log.info("rank %d: the hosts changed; leaving for horolite-run to restart the job at "
             "commit %d", basics.rank(), state._commit_key[0])
    sys.exit(0)


def run_fn(func: Callable, reset: Optional[Callable] = None) -> Callable:
    """Wrap `func(state, *args, **kwargs)` as Horovod's `run_fn` does, by restarts.

    `reset` (Horovod's shutdown/init between attempts) is never called: a reset is
    a new process."""
    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs):
        global _resumed
        if in_process.enabled():
            return _run_in_process(func, state, args, kwargs)
        session = current()
        if session is not None and not _resumed:
            _resumed = True
            resume(state)
            if session.generation > 0:
                state.on_reset()
        try:
            state.sync()
            return func(state, *args, **kwargs)
        except HostsUpdatedInterrupt:
            if session is None:
                raise
            _leave_for_reset(state)
        except HorovodInternalError as e:
            if is_runtime_failure(e):
                state.restore()
                raise
            _name_user_error(e)
            raise
        except Exception as e:
            if not is_runtime_failure(e):
                _name_user_error(e)
            raise
    return wrapper


def _run_in_process(func: Callable, state: State, args, kwargs):
    """Horovod's loop, with the survivors of a failure going on in this process: the
    last commit restored, the next world joined (in_process.rejoin), `on_reset`, and the
    state synced from the new rank 0 (the oldest survivor) before `func` runs again."""
    while True:
        try:
            state.sync()
            in_process.note_synced()
            return func(state, *args, **kwargs)
        except HostsUpdatedInterrupt:  # (at a commit: the state is the committed one)
            in_process.rejoin(None)
        except Exception as e:
            if not is_runtime_failure(e):
                _name_user_error(e)
                raise
            in_process.rejoin(e, restore=state.restore)
        state.on_reset()


def _name_user_error(exc: BaseException) -> None:
    """Tell horolite-run that the training code raised (so it does not restart the job)."""
    if (current() is None and not in_process.enabled()) or \
            getattr(exc, "_horolite_elastic_named", False):
        return
    try:
        exc._horolite_elastic_named = True
    except AttributeError:
        pass
    try:
        rank = str(basics.rank())
    except Exception:  # before init(): the MPI launcher's own variable
        rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "?"))
    launcher_marker(protocol.MARKER_KIND, event=protocol.USER_ERROR, rank=rank,
                    text=f"rank {rank} raised {describe_exception(exc)}")


def _excepthook(exc_type, exc, tb):
    """An exception the training script did not catch, outside `run` too (its setup: a
    bad argument, a Keras 3 incompatibility): the job ends with it, it is not restarted."""
    if issubclass(exc_type, Exception) and not is_runtime_failure(exc):
        _name_user_error(exc)
    _previous_hook(exc_type, exc, tb)


_previous_hook = sys.excepthook
if current() is not None or generations.worker() is not None:  # (horolite-run's elastic jobs)
    sys.excepthook = _excepthook
