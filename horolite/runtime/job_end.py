"""The end of a job that cannot go on: the Runtime's side of failure.py.

A rank whose user code raised, that got SIGTERM, or whose background thread found
a stall or heard another rank's failure notice fails every pending and later
collective with the cause, tells the other ranks (when the cause is its own),
prints a marker for horolite-run's summary, and makes sure the process ends: by
itself when its user code raises the error, else EXIT_GRACE_SECONDS later.
At an agreed shutdown, every rank learns which rank left and with what exit code.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import numpy as np

from ..errors import HorovodInternalError, ShutdownError, prefixed
from . import registry
from ..failure.links import LinkLost
from ..failure.shm_files import remove_mapped
from ..failure.channel import (Notice, caused_by_peer, describe_exception, hard_exit_after,
                               launcher_marker, signal_name)

__all__ = ["JobEnd", "EXIT_GRACE_SECONDS"]

_log = logging.getLogger("horolite")

# Seconds a rank whose job cannot go on has to end by itself (its user code raising the
# error) before it ends itself: a rank asleep in user code must not keep the job alive.
EXIT_GRACE_SECONDS = 3.0
# The same in an elastic job whose ranks recover in-process (horolite-run --gloo
# --min-np): its code is expected to handle the failure, which takes a restore and a
# shutdown() that may wait for a busy machine.
IN_PROCESS_GRACE_SECONDS = 30.0
# How long a rank that lost one of horolite's connections looks for another rank's notice
# first: a peer leaving a failed job closes its connections right after it heard one.
LOST_NOTICE_SECONDS = 0.1
# How long a process set's runtime, whose peer left with an error code, waits for the
# global set to hear the failure behind it (runtime/cycle.py's shutdown).
CAUSE_BEHIND_EXIT_SECONDS = 1.0


def _exit_grace() -> float:
    from ..core.mpi_library import without_mpi
    from ..world import generations
    return IN_PROCESS_GRACE_SECONDS if without_mpi() and generations.worker() else \
        EXIT_GRACE_SECONDS


def _fail_entries(entries, error: BaseException) -> None:
    """Each entry's handle fails with `error`, naming its tensor."""
    for entry in entries:
        entry.handle._set_exception(prefixed(error, f"tensor '{entry.request.name}'"))


class JobEnd:
    """Mixed into Runtime: uses its failures (FailureChannel), heartbeat, links, queue,
    transport, executor, rank, size, doomed, _hard_exit, _exiting, _late_lock and
    _shutdown_requested."""

    def report_exception(self, exc: BaseException, tb) -> None:
        """An uncaught exception is ending this process (main thread): tell the others."""
        if caused_by_peer(exc) or self.doomed is not None:
            self.failures.await_release()  # so that no peer is killed before it reports
            return  # the cause is elsewhere, and already reported
        text = f"{self.failures.where(self.rank)} failed: {describe_exception(exc, tb)}"
        launcher_marker("cause", rank=self.rank, code=1, text=text)
        self.doomed = HorovodInternalError(text)
        self.failures.announce(text)
        self.queue.wake.set()

    def report_signal(self, signum: int) -> None:
        """SIGTERM is ending this process: tell the others (unless they told us first)."""
        remove_mapped()  # it ends without MPI_Finalize (failure/shm_files.py)
        if self.doomed is not None or self.failures.heard is not None:
            return
        text = (f"{self.failures.where(self.rank)} was killed by signal {signum} "
                f"({signal_name(signum)})")
        # `at`: a signal from outside may itself follow another rank's death (Open MPI
        # stops the job with SIGTERM); horolite-run compares it with that rank's end.
        launcher_marker("cause", rank=self.rank, code=128 + signum, at=f"{time.time():.6f}",
                        text=text)
        # A launcher that stops the job after a rank died (Open MPI's: SIGTERM to the
        # others) makes this signal a consequence: name the peer that went first.
        gone = self.heartbeat.gone() if self.heartbeat is not None else {}
        if gone:
            first = "; ".join(f"{self.failures.where(q)} stopped answering (its process {pid} "
                              "is gone)" for q, pid in sorted(gone.items()))
            text = f"{first}; then {text}"
        self.doomed = HorovodInternalError(text)
        self.failures.announce(text)

    def _end_for_failure(self, notice: Optional[Notice], error: Optional[BaseException] = None):
        """Fail every pending and later collective with the cause, and end this process
        soon even if its user code is stuck elsewhere (failure.hard_exit_after)."""
        if notice is not None and notice.rank != self.rank:
            _log.error("rank %d: %s; failing this rank's collectives", self.rank, notice.text)
            launcher_marker("stopped", rank=self.rank, by=notice.cause, text=notice.text)
            self.failures.acknowledge()
            error = HorovodInternalError(notice.text)
            error.horolite_peer = notice.cause
            if notice.origin >= 0:  # (a rank found gone: the ranks an elastic job evicts)
                error.horolite_lost = [notice.origin]
        elif notice is not None:  # this rank's own notice (report_exception)
            error = self.doomed
        else:  # found on this rank: fail its collectives, then tell the others
            _log.error("rank %d: %s", self.rank, error)
            launcher_marker("cause", rank=self.rank, code=1, text=error)
            self._doom(error)
            # Ranks silent through a stall (a host cut off, a process stopped) would not
            # confirm the notice: the others are not held ACK_SECONDS waiting for them.
            self.failures.gone.update(getattr(error, "horolite_lost", ()))
            self.failures.announce(str(error))
            return
        self._doom(error)

    def _answer_late(self, entry) -> bool:
        with self._late_lock:
            return bool(entry.request.quorum) and self.executor.quorum.answer(entry)

    def _fail_pending(self, error: BaseException) -> int:
        self._fatal = self._fatal or error
        pending = self.queue.close(error)
        if self.queue.after_close is not None:
            pending = [entry for entry in pending if not self._answer_late(entry)]
        _fail_entries(pending, error)
        self._unsent.clear()
        self.hits.drain()
        return len(pending)

    def _end_for_mpi_error(self, exc: BaseException) -> None:
        """An MPI error in the background thread: a peer's loss when a peer is gone,
        else a failure of this rank's own, told to the others."""
        lost = self._lost_peer(exc)
        if lost is not None:
            self._end_for_lost_link(lost)
            return
        _log.exception("rank %d: background thread failed", self.rank)
        self._end_for_failure(None, HorovodInternalError(
            f"{self.failures.where(self.rank)}: horolite's background thread failed: {exc!r}"))

    def _unreachable(self) -> set:
        """Ranks no send may reach: behind a closed link, or whose process on this host is gone."""
        ranks = self.links.unsafe() if getattr(self, "links", None) is not None else set()
        if self.heartbeat is not None:
            ranks |= set(self.heartbeat.gone())
        return ranks

    def _lost_peer(self, exc: BaseException) -> Optional[LinkLost]:
        """An MPI error explained by a peer that is gone, as LinkLost; else None."""
        gone = self.heartbeat.gone() if self.heartbeat is not None else {}
        if gone:
            q, pid = min(gone.items())
            return LinkLost(f"{self.failures.where(q)}'s process ({pid}) is gone (MPI reported "
                            f"{str(exc).splitlines()[0][:200]})", sorted(gone))
        if getattr(self, "links", None) is not None:
            self.links.unsafe()
            if self.links.lost is not None:
                return self.links.lost
        return None

    def _end_for_lost_link(self, lost) -> None:
        """A peer's connection closed (failure/links.py), or MPI failed and a peer is gone:
        fail this rank's collectives naming it. On horolite's own connections, tell the
        others too (below), unless one of them already told this rank of a failure: a
        peer that leaves a failed job closes its connections, and it is not the cause."""
        if lost.own:
            notice = self._notice_within(LOST_NOTICE_SECONDS)
            if notice is not None:
                self._end_for_failure(notice)
                return
            mesh = self.transport.cross_host
            lost = mesh.lost if mesh is not None and mesh.lost is not None else lost
        text = f"{self.failures.where(self.rank)}: {lost}"
        _log.error("rank %d: %s; failing this rank's collectives", self.rank, lost)
        launcher_marker("stopped", rank=self.rank, by=lost.ranks[0], text=text)
        error = HorovodInternalError(text)
        error.horolite_peer = lost.ranks[0]
        error.horolite_lost = list(lost.ranks)  # (the ranks an elastic job without MPI evicts)
        if lost.own:  # (told before this rank's user code hears of it, and may end)
            self._announce_gone(lost)
        self._doom(error)
        # Over MPI's own links no notice: any MPI call now could make MPI progress the
        # collectives this rank abandoned, which send to that peer. They see the link close
        # themselves, or hear from the launcher (and under mpirun, MPI's cleanup ends the job).

    def _notice_within(self, seconds: float):
        """Another rank's failure notice, if one arrives within `seconds`."""
        deadline = time.monotonic() + seconds
        while True:
            notice = self.failures.check()
            if notice is not None and notice.rank != self.rank:
                return notice
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.002)

    def _announce_gone(self, lost) -> None:
        """Tell the other ranks that the peer behind `lost` is gone, naming it as the
        failure's origin (failure/channel.py), so those with no connection to it name it."""
        gone = lost.ranks[0]
        text = f"{self.failures.where(gone)} is gone ({self.failures.where(self.rank)}: {lost})"
        try:
            self.failures.announce_gone(gone, text)
        except Exception as e:  # (MPI itself failing: the others still see links close)
            _log.debug("rank %d: could not tell the others that rank %d is gone: %r",
                       self.rank, gone, e)

    def _doom(self, error: BaseException) -> None:
        """This rank cannot go on: its collectives fail, every process set's on it too."""
        first = self.doomed is None
        # Doomed first: user code woken by the failed handles must see the cause is known.
        self.doomed = self.doomed or error
        self._fail_pending(error)
        if self._hard_exit is None:
            self._hard_exit = hard_exit_after(_exit_grace(), 1, f"rank {self.rank}: {error}",
                                              before=remove_mapped)
        if first:
            for other in registry.runtimes():
                if other is not self:
                    other.doom_from_sibling(error)

    def doom_from_sibling(self, error: BaseException) -> None:
        """Another runtime of this process (another process set's) was doomed: fail this
        one's pending and later collectives with the same error (the caller's thread; this
        runtime's own thread may be waiting on the rank that failed)."""
        if self.doomed is not None:
            return
        self.doomed = error
        self._fatal = self._fatal or error
        _fail_entries(self.queue.close(error), error)

    def _shutdown_error(self) -> ShutdownError:
        """Who stopped the job, and how (one small allgather: every rank agreed on the
        shutdown in this same cycle, so every rank makes it). A rank's word: 0 it did not
        ask, 1 its process is exiting (with the code after it), 2 it called shutdown()."""
        asked = self._shutdown_requested.is_set()
        mine = np.array([1 if self._exiting is not None else 2 if asked else 0,
                         -1 if self._exiting is None else self._exiting], dtype=np.int64)
        everyone = self.transport.allgather_ints(mine)
        leavers = [q for q in range(self.size) if everyone[q][0] == 1] or \
            [q for q in range(self.size) if everyone[q][0] == 2]
        if not leavers:
            return ShutdownError("horolite was shut down (shutdown() was called on a rank) "
                                 "before this collective completed")
        first = leavers[0]
        code = int(everyone[first][1])
        if everyone[first][0] == 2:
            error = ShutdownError(f"horolite was shut down: {self.failures.where(first)} "
                                  "called shutdown() before this collective completed on "
                                  "every rank")
        else:
            how = f"its process exited with code {code}" if code >= 0 else "its process exited"
            error = ShutdownError(f"{self.failures.where(first)} left the job ({how}) before "
                                  "this collective completed on every rank")
        if first != self.rank:
            error.horolite_peer = first
        error.horolite_exit_code = code if everyone[first][0] == 1 else None
        return error

    def _cause_behind(self, error: ShutdownError) -> BaseException:
        """A process set's peer that left with an error code most often failed because
        another rank of the job did (its notice came to the global set, in its own
        thread): that failure, once the global set has it, rather than the departure."""
        code = getattr(error, "horolite_exit_code", None)
        if self.leader is None or not code or getattr(error, "horolite_peer", None) is None:
            return error
        deadline = time.monotonic() + CAUSE_BEHIND_EXIT_SECONDS
        while self.leader.doomed is None and time.monotonic() < deadline:
            time.sleep(0.005)
        return self.leader.doomed or error
