"""Why a rank went: told to the other ranks before the process goes, heard by them at once.

A rank that fails (an uncaught exception, a fatal signal, a collective stalled past
the shutdown time) or leaves while others may still wait sends every other rank a
short notice on a communicator of its own: "rank 1 (host node2) failed: RuntimeError:
bad batch (train.py:57)". Every rank keeps one receive posted for it, and every wait
the background thread makes inside MPI tests it (transport/mpi.py's Waiter), so a rank
blocked in a collective with the failed one hears it too. The runtime does this itself,
so it holds under plain mpirun and srun as well as horolite-run; under horolite-run the
failing rank also prints a marker line the launcher's summary reads.

A rank that finds a peer gone (its connection closed: runtime/job_end.py) tells the
others too, naming that peer as the failure's origin (Notice.origin), so ranks that had
no connection to it name it rather than the neighbour they see leave after it.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import struct
import sys
import threading
import time
import traceback
from typing import List, Optional, Sequence

import numpy as np
from ..core.mpi_library import MPI

from .links import LinkLost
from .process_hooks import exit_now

__all__ = ["Notice", "FailureChannel", "PeerFailure", "describe_exception", "where_raised",
           "caused_by_peer", "hard_exit_after", "launcher_marker", "signal_name"]

_log = logging.getLogger("horolite.failure.channel")

_TAG = 18
_ACK_TAG = 19
_RELEASE_TAG = 20
_ENDED_TAG = 21
NOTICE_BYTES = 4096
_ORIGIN = struct.Struct("<i")  # a notice's first bytes: Notice.origin
# How often a cycle looks for a notice (waits look too, every 20 ms: collective_watch.py).
LOOK_SECONDS = 0.001
# How long a failing rank waits for the others to confirm its notice (a running peer
# does within a few milliseconds; a frozen one never does).
ACK_SECONDS = 3.0
# How long a rank that only heard of a failure stays after every rank said it ended, so
# the rank the failure came from ends first: plain mpirun and srun name the first rank to
# end with an error as the job's failure.
ORIGIN_LEAD_SECONDS = 0.15
_OWN_DIR = os.path.dirname(os.path.abspath(__file__))
_MARKER = "##horolite-run##"


@dataclasses.dataclass(frozen=True)
class Notice:
    """What one rank (`rank`, the sender) told the others: why the job cannot go on.
    `origin`: the rank the failure came from, when not the sender: a peer it found gone."""
    rank: int
    text: str
    origin: int = -1

    @property
    def cause(self) -> int:
        """The rank to name as the failure's origin."""
        return self.rank if self.origin < 0 else self.origin

    def encode(self) -> bytes:
        return _ORIGIN.pack(self.origin) + self.text.encode("utf-8", "replace")[
            :NOTICE_BYTES - _ORIGIN.size]

    @classmethod
    def decode(cls, rank: int, raw: bytes) -> "Notice":
        origin = _ORIGIN.unpack_from(raw)[0] if len(raw) >= _ORIGIN.size else -1
        text = raw[_ORIGIN.size:].decode("utf-8", "replace")
        return cls(rank, text or f"rank {rank} failed", origin)


class PeerFailure(Exception):
    """Raised inside a wait when another rank's notice arrived."""

    def __init__(self, notice: Notice):
        super().__init__(notice.text)
        self.notice = notice


class FailureChannel:
    """Posts the receive for other ranks' notices, tests it, and sends this rank's own."""

    def __init__(self, comm: MPI.Comm, hostnames: Sequence[str]):
        self.comm = comm.Dup()
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.hostnames = list(hostnames)
        self.heard: Optional[Notice] = None
        self._next_look = 0.0  # see check
        self.sent: Optional[Notice] = None
        self.unconfirmed: List[int] = []  # peers that neither confirmed nor crossed its notice
        self.gone: set = set()  # ranks a notice (sent or heard) says are gone: never sent to
        self._said_ended = False
        self._lock = threading.Lock()
        self._inbox = np.zeros(NOTICE_BYTES, dtype=np.uint8)
        self.status = MPI.Status()
        # Ranks a send must not reach (links.LinkWatch.unsafe), and whether this rank must
        # not touch MPI at all any more (a link closed: the collectives it abandoned would
        # send to that peer from inside any progress): set by the runtime.
        self.unsafe = lambda: set()
        self.silent = lambda: False
        self.request = (self.comm.Irecv(self._inbox, source=MPI.ANY_SOURCE, tag=_TAG)
                        if self.size > 1 else None)

    def where(self, rank: int) -> str:
        """'rank 1 (host node2)'."""
        host = self.hostnames[rank] if 0 <= rank < len(self.hostnames) else "?"
        return f"rank {rank} (host {host})"

    def check(self, now: Optional[float] = None) -> Optional[Notice]:
        """The first notice another rank sent, once it has arrived (background thread).
        `now` (a cycle's clock): MPI is asked at most every LOOK_SECONDS, since each look
        is a turn of MPI's progress engine, microseconds on every cycle of a small call."""
        if now is not None:
            if now < self._next_look:
                return self.heard
            self._next_look = now + LOOK_SECONDS
        if self.heard is None and self.request is not None:
            with self._lock:
                if self.request is not None and self.request.Test(self.status):
                    self.completed()
        return self.heard

    def completed(self) -> None:
        """The receive finished (Test here, or a Waitany on it in the Waiter)."""
        count = self.status.Get_count(MPI.BYTE)
        self.heard = Notice.decode(self.status.Get_source(), self._inbox[:count].tobytes())
        self.request = None
        if self.heard.origin >= 0:
            self.gone.add(self.heard.origin)

    def close(self) -> None:
        """Collective (every rank stopping together): drop the posted receive."""
        if self.request is not None:
            self.request.Cancel()
            self.request.Wait()
            self.request = None
        try:
            self.comm.Free()
        except MPI.Exception:
            pass

    def acknowledge(self) -> None:
        """Tell the rank whose notice arrived that this rank has it (and has reported it)."""
        if self.heard is not None and not self.silent() and self.heard.rank not in self.unsafe():
            try:
                self.comm.Isend(np.zeros(1, dtype=np.uint8), dest=self.heard.rank, tag=_ACK_TAG)
            except LinkLost:  # (the teller has left since: in an elastic job, to re-form)
                pass

    def announce(self, text: str) -> bool:
        """Send this rank's notice to every other rank, once, and wait up to ACK_SECONDS
        for them to confirm (their background threads report it before they do); a peer
        that is frozen or gone does not hold this rank longer. False if this rank already
        announced, or heard another rank's notice first (then it is not the cause)."""
        if self.sent is not None or self.heard is not None or self.size == 1 or self.silent():
            return False
        self.sent = Notice(self.rank, text)
        data = np.frombuffer(self.sent.encode(), dtype=np.uint8)
        peers = self._reachable_peers()
        acks = np.zeros(len(peers), dtype=np.uint8)
        confirmed = [self.comm.Irecv(acks[i:i + 1], source=q, tag=_ACK_TAG)
                     for i, q in enumerate(peers)]
        sends = [self.comm.Isend(data, dest=q, tag=_TAG) for q in peers]
        self._await_confirmations(peers, confirmed)
        _wait_until(sends, time.monotonic() + 0.5)
        # Every peer has reported it: they may end now (await_release). Until then one
        # ending early would make mpirun kill the others before they had said why.
        release = [self.comm.Isend(np.zeros(1, dtype=np.uint8), dest=q, tag=_RELEASE_TAG)
                   for q in peers]
        _wait_until(release, time.monotonic() + 0.5)
        return True

    def _await_confirmations(self, peers, confirmed) -> None:
        """Until each peer confirmed this rank's notice, or sent one of its own at the same
        moment (two survivors that found the same stall: each waits for the other's
        confirmation, and neither gives one, so each takes the other's notice for it), or
        ACK_SECONDS passed."""
        boxes = np.zeros((len(peers), NOTICE_BYTES), dtype=np.uint8)
        crossing = [self.comm.Irecv(boxes[i], source=q, tag=_TAG) for i, q in enumerate(peers)]
        deadline, pending = time.monotonic() + ACK_SECONDS, set(range(len(peers)))
        try:
            while pending and time.monotonic() < deadline:
                with self._lock:  # (the first notice lands in the receive posted at
                    if self.request is not None and _test(self.request, self.status):
                        self.request = None  # start: it crossed this one, not heard first)
                        first = self.status.Get_source()
                        self._crossed(first, self._inbox)
                        pending -= {i for i, q in enumerate(peers) if q == first}
                for i in list(pending):
                    try:
                        crossed = bool(crossing[i].Test())
                    except LinkLost:  # (that peer is gone: nothing more comes from it)
                        pending.discard(i)
                        continue
                    if crossed:
                        self._crossed(peers[i], boxes[i])
                    if crossed or _test(confirmed[i]):
                        pending.discard(i)
                if pending:
                    time.sleep(0.002)
        finally:
            for request in crossing + confirmed:
                if request:
                    try:
                        request.Cancel()
                        request.Wait()
                    except (MPI.Exception, LinkLost):
                        pass
        self.unconfirmed = [peers[i] for i in sorted(pending)]

    def _crossed(self, rank: int, raw) -> None:
        """A peer's notice that crossed this rank's: the rank it names as gone is gone."""
        origin = Notice.decode(rank, raw.tobytes()).origin
        if origin >= 0:
            self.gone.add(origin)

    def announce_gone(self, origin: int, text: str) -> bool:
        """This rank found `origin` gone (its connection closed): tell every other rank,
        naming it as the failure's origin. Not waited on: the peers that also found it
        gone announce it at the same moment, from their background threads, which would
        then wait for each other's confirmation; the ranks still end together (say_ended).
        False if this rank already announced or heard of a failure."""
        self.gone.add(origin)
        if self.sent is not None or self.check() is not None or self.size == 1:
            return False
        peers = self._reachable_peers()  # (looks at MPI's links first: silent may change)
        if self.silent():
            return False
        self.sent = Notice(self.rank, text, origin)
        data = np.frombuffer(self.sent.encode(), dtype=np.uint8)
        requests = [self.comm.Isend(data, dest=q, tag=_TAG) for q in peers]
        # (free to end at once: nobody waits for this rank's confirmation round)
        requests += [self.comm.Isend(np.zeros(1, dtype=np.uint8), dest=q, tag=_RELEASE_TAG)
                     for q in peers]
        _wait_until(requests, time.monotonic() + 0.5)
        return True

    def await_release(self) -> None:
        """Before this rank ends because of another rank's notice: wait (up to
        ACK_SECONDS) until that rank has heard every peer confirm it."""
        if self.heard is None or self.heard.rank == self.rank or self.silent():
            return
        flag = np.zeros(1, dtype=np.uint8)
        request = self.comm.Irecv(flag, source=self.heard.rank, tag=_RELEASE_TAG)
        if not _wait_until([request], time.monotonic() + ACK_SECONDS + 0.5):
            request.Cancel()

    def say_ended(self) -> None:
        """This rank is done with a job that failed (it is ending, or its user code shut
        horolite down): tell every peer, which may be holding its own end for it."""
        if not self._in_failed_job() or self._said_ended:
            return
        self._said_ended = True
        requests = []
        for q in self._reachable_peers():
            try:
                requests.append(self.comm.Isend(np.zeros(1, dtype=np.uint8), dest=q,
                                                tag=_ENDED_TAG))
            except LinkLost:  # (its connection closed since: it ended, nothing to tell)
                pass
        try:
            _wait_until(requests, time.monotonic() + 0.5)
        except LinkLost:
            pass

    def await_ended(self, seconds: float) -> bool:
        """Before a rank of a failed job ends: wait up to `seconds` for every peer to say
        it ended. Once one rank ends with an error, mpirun ends the others, and their user
        code may still be handling the error it got (logging it, saving state): so every
        rank ends only when all are done with it."""
        if not self._in_failed_job():
            return True
        peers = self._reachable_peers()
        flags = np.zeros(len(peers), dtype=np.uint8)
        requests = [self.comm.Irecv(flags[i:i + 1], source=q, tag=_ENDED_TAG)
                    for i, q in enumerate(peers)]
        if _wait_until(requests, time.monotonic() + seconds):
            return True
        for request in requests:
            request.Cancel()
        return False

    def let_the_origin_end_first(self) -> None:
        """After `await_ended` succeeded: a rank that did not announce the failure waits
        ORIGIN_LEAD_SECONDS, so the rank that did (already free to go) ends before it. Else
        the last rank to say it ended, the one with the slowest handler, would end first."""
        if self._in_failed_job() and self.sent is None:
            time.sleep(ORIGIN_LEAD_SECONDS)

    def _in_failed_job(self) -> bool:
        """A notice went or came, and MPI may still be used."""
        return (self.sent is not None or self.heard is not None) and not self.silent()

    def _reachable_peers(self) -> list:
        """Every other rank but those no send may reach (`unsafe`, `gone`)."""
        unsafe = self.unsafe() | self.gone
        return [q for q in range(self.size) if q != self.rank and q not in unsafe]


def _test(request, status=None) -> bool:
    """Whether `request` completed (a request failed by a lost connection counts)."""
    try:
        return bool(request.Test(status) if status is not None else request.Test())
    except LinkLost:
        return True


def _wait_until(requests, deadline: float) -> bool:
    """Whether every request completed by `deadline`. On horolite's own connections a
    request whose peer's connection closed fails (LinkLost) rather than never completing,
    as under MPI: that peer is gone, so it is done with (it has ended, and will send
    nothing more), and the wait goes on for the others."""
    while True:
        try:
            if MPI.Request.Testall(requests):
                return True
        except LinkLost:
            pass  # (the failed request is seen now: the next Testall passes over it)
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.002)


def where_raised(tb) -> str:
    """file:line of the innermost frame of the user's code (not horolite's, not Python's)."""
    frames = traceback.extract_tb(tb)
    stdlib = os.path.dirname(os.__file__)
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        if not (path.startswith(_OWN_DIR) or path.startswith(stdlib) or "site-packages" in path
                or frame.filename.startswith("<frozen")):
            return f"{os.path.basename(frame.filename)}:{frame.lineno}"
    return f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else "?"


def describe_exception(exc: BaseException, tb=None) -> str:
    """'RuntimeError: bad batch (train.py:57)'."""
    message = str(exc).strip().splitlines()
    text = type(exc).__name__ + (f": {message[0]}" if message else "")
    return f"{text} ({where_raised(tb or exc.__traceback__)})"


def caused_by_peer(exc: BaseException) -> bool:
    """True for the runtime's errors that report another rank's failure."""
    return getattr(exc, "horolite_peer", None) is not None


def _under_rank_wrapper() -> bool:
    """True when horolite-run's rank wrapper is this process's parent (Linux /proc)."""
    global _wrapped
    if _wrapped is None:
        try:
            with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
                _wrapped = b"rankwrap" in f.read()
        except OSError:
            _wrapped = False
    return _wrapped


_wrapped: Optional[bool] = None


def launcher_marker(kind: str, **fields) -> None:
    """A line for horolite-run's summary, only under it (its rank wrapper reads it)."""
    if not _under_rank_wrapper():
        return
    text = " ".join(f"{k}={v}" for k, v in fields.items() if k != "text")
    line = f"{_MARKER} {kind} {text}"
    if "text" in fields:
        line += " text=" + " ".join(str(fields["text"]).split())
    try:
        sys.stderr.flush()
        os.write(2, (line + "\n").encode("utf-8", "replace"))
    except OSError:
        pass


def hard_exit_after(seconds: float, code: int, why: str, before=None) -> threading.Event:
    """End this process `seconds` from now unless it has ended by itself: a rank stuck in
    user code must not keep the job alive. Setting the returned event cancels it.
    `before()`, if given, runs first (the job's shared memory removed, say)."""
    cancel = threading.Event()

    def run():
        if cancel.wait(seconds):
            return
        _log.error("%s: ending this process now (exit code %d)", why, code)
        if before is not None:
            before()
        exit_now(code)
    threading.Thread(target=run, name="horolite-hard-exit", daemon=True).start()
    return cancel


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
