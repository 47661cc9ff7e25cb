"""Stalls inside a collective, and other ranks' failures, noticed from within a wait.

The stall inspector (stall.py) sees tensors some ranks never submitted. Once a
collective runs, a peer that freezes (SIGSTOP, a swapped-out host, a link down)
leaves this rank waiting inside MPI or the shared-memory loop, where no cycle
runs. Every transport's waits call CollectiveWatch every few tens of
milliseconds instead (transport/mpi.py's Waiter, the shared-memory loop's tick;
a hierarchical transport passes it on the same way), so the wait is reported
after HOROLITE_STALL_CHECK_TIME_SECONDS, given up after
HOROLITE_STALL_SHUTDOWN_TIME_SECONDS, and abandoned at once when another rank's
failure notice arrives. The waits also keep this rank's heartbeat going
(heartbeat.py), so a stall names the peers no longer heard from: the rank that
froze, or every rank of a host whose link is down, rather than the neighbour
that merely waits for them too.
"""
from __future__ import annotations

import logging
from typing import Optional, Sequence, Union

from ..core.mpi_library import chosen, without_mpi
from ..errors import StallError
from .channel import FailureChannel, PeerFailure
from .heartbeat import Heartbeat

__all__ = ["CollectiveWatch"]

_log = logging.getLogger("horolite.coordination.stall")


class CollectiveWatch:
    def __init__(self, channel: FailureChannel, warn_after: float, shutdown_after: float,
                 enabled: bool = True, heartbeat: Optional[Heartbeat] = None):
        self.channel = channel
        self.heartbeat = heartbeat
        self.rank = channel.rank
        self.warn_after = warn_after
        self.shutdown_after = shutdown_after if enabled else 0.0
        self.enabled = enabled
        # What the background thread is running: set per batch by the executor.
        self.what = "this cycle's control message"
        # Called first in every look: raises what another thread of this rank met (the
        # exchange lane's error, execution/lane.py), so this wait ends with it.
        self.also = None
        self._next_warning = warn_after
        self._last_waited = 0.0

    def peers_text(self, peers: Union[int, Sequence[int], None]) -> str:
        if peers is None or peers == -1 or (not isinstance(peers, int) and not peers):
            return "other ranks"
        ranks = [peers] if isinstance(peers, int) else list(peers)
        return ", ".join(self.channel.where(q) for q in ranks)

    def __call__(self, waited: float, peers=None) -> None:
        """Called from inside a wait that has lasted `waited` seconds on `peers`."""
        if self.also is not None:
            self.also()
        if self.heartbeat is not None and self.heartbeat.links is not None:
            self.heartbeat.links.check()  # raises LinkLost before MPI progresses again
        if without_mpi():  # (a wait elsewhere, on shared memory, hears of it here)
            chosen().check_lost()  # (the world the runtime holds)
        notice = self.channel.check()
        if notice is not None:
            raise PeerFailure(notice)
        if self.channel.sent is not None:
            raise PeerFailure(self.channel.sent)  # this rank is going: stop waiting
        if not self.enabled:
            return
        if self.heartbeat is not None:
            self.heartbeat.tick()
        if waited < self._last_waited:  # a new wait
            self._next_warning = self.warn_after
        self._last_waited = waited
        warn = waited >= self._next_warning
        stop = self.shutdown_after and waited >= self.shutdown_after
        if not (warn or stop):
            return
        silent = self.heartbeat.silent() if self.heartbeat is not None else {}
        if warn:
            self._next_warning = waited + self.warn_after
            if silent:
                _log.warning("rank %d: %s has waited %.0f s inside a collective: %s "
                             "(stopped, or a link down?)", self.rank, self.what, waited,
                             self.silence_text(silent))
            else:
                _log.warning("rank %d: %s has waited %.0f s inside a collective for %s "
                             "(stopped, or a link down?)", self.rank, self.what, waited,
                             self.peers_text(peers))
        if stop:
            here = f"{self.what} stalled inside a collective for {waited:.0f} s on " \
                   f"{self.channel.where(self.rank)}"
            setting = f"HOROLITE_STALL_SHUTDOWN_TIME_SECONDS={self.shutdown_after:g}"
            if silent:
                error = StallError(f"{here}: {self.silence_text(silent)} ({setting}); "
                                   "shutting the job down")
                error.horolite_lost = sorted(silent)
                raise error
            error = StallError(f"{here}, waiting for {self.peers_text(peers)} ({setting}); "
                               "shutting the job down")
            if peers is not None:  # (the ranks an elastic job without MPI evicts)
                error.horolite_lost = [peers] if isinstance(peers, int) else sorted(peers)
            raise error

    def silence_text(self, silent) -> str:
        """'no word from rank 2 (host node2), rank 3 (host node2) for 12 s'."""
        text = f"no word from {self.peers_text(sorted(silent))} for {min(silent.values()):.0f} s"
        gone = self.heartbeat.gone() if self.heartbeat is not None else {}
        return text + "".join(f"; rank {q}'s process ({pid}) is gone" for q, pid in
                              sorted(gone.items()) if q in silent)
