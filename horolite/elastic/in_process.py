"""Recovery inside the running processes, for elastic jobs without MPI.

Under ``horolite-run --gloo --min-np N`` the launcher keeps the job's rendezvous and
announces each generation of the world (launcher/elastic_gloo.py,
horolite/world/generations.py). A rank moves to the next one:

- after a failure (its step failed because the job lost a rank): it says at the
  rendezvous whom it blames (the rank its error names, so that a rank that hangs
  rather than dies is evicted too), restores the last commit, shuts its runtime down,
  meets the survivors in the new generation and starts the runtime again;
- at a commit, when a newer generation was announced (a worker is ready to join, or a
  host left): every rank agrees, raises HostsUpdatedInterrupt, and moves.

The same process, its imports and its traced functions go on; only the connections are
new, made under a key of their generation (world/sockets.py, generation_key), so a rank
of an older world can never join a newer one.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import List, Optional

from ..core import mpi_library
from ..world import generations
from .session import log

__all__ = ["enabled", "generation", "rejoin", "newest_announced", "world_moved_on",
           "note_commit", "note_synced", "last_rejoin_seconds"]

last_rejoin_seconds = 0.0  # how long the last move to a new generation took (logged too)


def enabled() -> bool:
    """Whether this rank recovers in its running process (a --gloo elastic job)."""
    return generations.worker() is not None and mpi_library.without_mpi()


def generation() -> int:
    return generations.current()


def _blamed(error: Optional[BaseException]) -> List[int]:
    """The ranks this rank found lost (a closed connection, silent in a stall): none when
    it only heard of the failure from another rank, which names them itself."""
    if error is None:
        return []
    from ..api import basics
    rt = basics._current_runtime()
    for found in (error, getattr(rt, "doomed", None) if rt is not None else None):
        lost = getattr(found, "horolite_lost", None)
        if lost:
            return list(lost)
    return []


def _blame(c, generation: int, ranks: List[int]) -> None:
    generations.blame(c, generation, ranks)


_client = None


def _ask(request):
    """`request(client)` at the job's rendezvous, over a connection kept between calls
    (made again once if it broke)."""
    global _client
    from .. import world
    from ..world.rendezvous import RendezvousError
    for attempt in (0, 1):
        if _client is None:
            _client = generations.client(world.identity_used())
        try:
            return request(_client)
        except RendezvousError:
            _client.close()
            _client = None
            if attempt:
                raise
    raise AssertionError("unreachable")


def newest_announced() -> int:
    """The newest generation horolite-run announced (one round trip to the rendezvous)."""
    return _ask(generations.latest)


_commits = 0
_synced = False


def note_commit() -> None:
    """Rank 0 at each commit: the job made progress (horolite-run ends a job whose
    failures repeat with no commit between them). One round trip."""
    global _commits
    _commits += 1
    value = f"{generations.worker()} {_commits}".encode()
    _ask(lambda c: c.put(generations.SCOPE, "commit", value))


def note_synced() -> None:
    """After this worker's first sync: it holds the training state (horolite-run ends the
    job when no member of a generation holds it, instead of training from scratch)."""
    global _synced
    if not _synced:
        value = str(generation()).encode()
        _ask(lambda c: c.put(generations.SCOPE, f"synced.{generations.worker()}", value))
        _synced = True


def world_moved_on() -> bool:
    """Whether horolite-run announced a generation newer than this rank's world (so an
    error this rank met is its world's end, not the training code's: it was evicted while
    stopped, or its peers left). False when the rendezvous cannot say."""
    from ..world.rendezvous import RendezvousError
    try:
        return newest_announced() > generation()
    except (RendezvousError, OSError, ValueError):
        return False


@contextlib.contextmanager
def _blame_if_late(c, generation: int):
    """The runtime's set-up in a new world waits on its ranks without a bound of its own:
    if it has not ended within --gloo-timeout-seconds, name at the rendezvous the ranks
    this rank's waits are for (one that hangs, e.g. stopped, is evicted; its connections
    then close and this set-up fails, and the next generation forms without it)."""
    from .. import world

    def late():
        comm = getattr(mpi_library.chosen(), "COMM_WORLD", None)
        waits = getattr(getattr(comm, "mesh", None), "_posted", None) or ()
        ranks = sorted({r.want for r in list(waits) if getattr(r, "want", -1) >= 0})
        log.warning("%s: generation %d has not started within %g s: waiting for ranks %s",
                    generations.worker(), generation, world.gloo_timeout(), ranks or "?")
        if ranks:
            try:
                _blame(c, generation, ranks)
            except Exception as e:  # (the rendezvous gone: nobody can be told)
                log.warning("could not say so at the rendezvous: %s", e)
    timer = threading.Timer(world.gloo_timeout(), late)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def rejoin(error: Optional[BaseException], restore=None) -> int:
    """Leave this world (after `error`, a runtime failure; or None: at a commit, for a
    newer generation) and enter the next generation that holds this worker; returns its
    number. Ends the process (code 0) when the newest plan leaves this worker out."""
    from .. import world
    from ..api import basics
    started = time.perf_counter()
    before = generations.current()
    c = generations.client(world.identity_used())
    try:
        if error is not None:
            _blame(c, before, _blamed(error))
        if restore is not None:  # (after the blame: the launcher's grace is for it)
            restore()
        basics.shutdown()
        while True:
            try:
                newest = generations.enter_next(c, world.identity_used(), before,
                                                world.reopen, False)
            except generations.LeftOut as e:
                log.info("%s; this worker ends", e)
                raise SystemExit(0) from None
            try:
                with _blame_if_late(c, newest):
                    basics.init()
            except Exception as e:  # (a rank of the new world died while it started)
                log.warning("%s: generation %d failed as it started (%s); waiting for the "
                            "next", generations.worker(), newest, e)
                _blame(c, newest, list(getattr(e, "ranks", None) or _blamed(e)))
                basics.shutdown()
                before = newest
                continue
            c.put(generations.SCOPE, f"entered.{generations.worker()}", str(newest).encode())
            break
    finally:
        c.close()
    global last_rejoin_seconds
    last_rejoin_seconds = time.perf_counter() - started
    log.info("rank %d of %d: generation %d formed in %.2f s (%s)", basics.rank(),
             basics.size(), newest, last_rejoin_seconds,
             f"after: {error}" if error is not None else "at a commit")
    return newest
