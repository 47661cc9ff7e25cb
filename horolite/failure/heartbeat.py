"""Which peers are still heard from: a one-byte message to every peer about once a second.

A stall inside a collective or in the per-cycle control message shows only that
this rank waits; on a ring the rank it waits for may itself be waiting for the
one that froze. So every rank's background thread sends each peer a tiny message
every INTERVAL seconds (from its cycle and from inside its waits, via
CollectiveWatch) and notes when it last heard each peer. A stall past the
shutdown time then names the peers not heard from: a frozen rank, or every rank
of a host whose link is down. Non-blocking throughout: one receive stays posted
per peer, and a peer whose previous message is still unsent gets no new one.

A peer on this host can also be looked up directly: a process killed by SIGKILL
is gone from the process table at once, before anything times out. Where the
launcher then stops the other ranks with SIGTERM (Open MPI's does; MPICH's kills
them outright), the rank stopped says which peer went first.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Dict, Iterable, List, Optional

import numpy as np
from ..core.mpi_library import MPI

__all__ = ["Heartbeat", "INTERVAL", "SILENT_AFTER", "processes_gone", "stat_says_gone"]

_TAG = 21
# Seconds between two messages to a peer, and between two looks at the receives.
INTERVAL = 1.0
_LOOK_EVERY = 0.2
# A peer not heard from for this long is silent (a running one sends every INTERVAL;
# a busy machine may delay one message, not two).
SILENT_AFTER = 2.5 * INTERVAL
# At shutdown, how long a rank takes in its peers' last beats (see Heartbeat.close).
BYE_SECONDS = 2.0


class Heartbeat:
    """Sends and hears the beats (the background thread, and the exchange lane's waits);
    `silent()` names who is quiet."""

    def __init__(self, comm: MPI.Comm, hostnames: List[str], links=None):
        """links: a links.LinkWatch, checked before the beats go out (it raises LinkLost)."""
        self.comm = comm.Dup()
        self.links = links
        self.rank = comm.Get_rank()
        self.peers = [q for q in range(comm.Get_size()) if q != self.rank]
        # Every rank's process id, for the peers on this host (gone()).
        pids = comm.allgather(os.getpid())
        self.pids_here = {q: pids[q] for q in self.peers if hostnames[q] == hostnames[self.rank]}
        now = time.monotonic()
        self.last_heard: Dict[int, float] = {q: now for q in self.peers}
        self._byte = np.zeros(1, dtype=np.uint8)
        self._inbox = np.zeros(len(self.peers), dtype=np.uint8)
        self._recvs = [self._post(i) for i in range(len(self.peers))]
        self._sends: List[Optional[MPI.Request]] = [None] * len(self.peers)
        self._next_look = now
        self._next_send = now
        self._lock = threading.RLock()

    def _post(self, i: int) -> MPI.Request:
        return self.comm.Irecv(self._inbox[i:i + 1], source=self.peers[i], tag=_TAG)

    def tick(self, now: Optional[float] = None) -> None:
        """Cheap unless a look is due (every _LOOK_EVERY s): hear, and beat every INTERVAL.
        (The exchange lane's waits tick too, from their thread: one at a time.)"""
        now = time.monotonic() if now is None else now
        if now < self._next_look or not self.peers:
            return
        with self._lock:
            self._tick(now)

    def _tick(self, now: float) -> None:
        self._next_look = now + _LOOK_EVERY
        if self.links is not None:
            self.links.check()  # before MPI's progress, as every send is (links.py)
        self._hear(now)
        if now >= self._next_send:
            self._next_send = now + INTERVAL
            for i, q in enumerate(self.peers):
                send = self._sends[i]
                if send is None or send.Test():
                    self._sends[i] = self.comm.Isend(self._byte, dest=q, tag=_TAG)

    def _hear(self, now: float) -> None:
        with self._lock:
            while True:
                done = MPI.Request.Testsome(self._recvs)
                if not done:
                    return
                for i in done:
                    self.last_heard[self.peers[i]] = now
                    self._recvs[i] = self._post(i)

    def silent(self, now: Optional[float] = None) -> Dict[int, float]:
        """{peer: seconds since it was last heard} for every peer quiet past SILENT_AFTER."""
        now = time.monotonic() if now is None else now
        self._hear(now)
        return {q: now - t for q, t in self.last_heard.items() if now - t > SILENT_AFTER}

    def gone(self) -> Dict[int, int]:
        """{peer: pid} of the peers on this host whose process is no longer running."""
        dead = set(processes_gone(self.pids_here.values()))
        return {q: pid for q, pid in self.pids_here.items() if pid in dead}

    def close(self, unreachable=()) -> None:
        """Every rank stopping together. Beats sent while a link was down arrive late, all
        at once; left unmatched, the MPI library complains about each at MPI_Finalize
        (UCX: 'unexpected tag-receive descriptor ... was not matched'). So each rank
        sends every peer a last beat marked 'bye' and takes in that peer's beats until
        its bye arrives (messages between two ranks arrive in order), for at most
        BYE_SECONDS; only then are the receives still posted cancelled. A peer in
        `unreachable` (gone, or behind a closed link) is neither sent to nor waited for."""
        unreachable = set(unreachable)
        peers = [i for i, q in enumerate(self.peers) if q not in unreachable]
        bye = np.ones(1, dtype=np.uint8)
        sends = [s for s in self._sends if s is not None]
        sends += [self.comm.Isend(bye, dest=self.peers[i], tag=_TAG) for i in peers]
        waiting = set(peers)
        deadline = time.monotonic() + BYE_SECONDS
        while waiting and time.monotonic() < deadline:
            done = MPI.Request.Testsome([self._recvs[i] for i in sorted(waiting)])
            if not done:
                time.sleep(0.001)
                continue
            order = sorted(waiting)
            for j in done:
                i = order[j]
                if self._inbox[i] == 1:
                    waiting.discard(i)  # its bye: nothing more comes from that peer
                    self._recvs[i] = MPI.REQUEST_NULL
                else:
                    self._recvs[i] = self._post(i)
        for r in self._recvs:
            if r != MPI.REQUEST_NULL:
                r.Cancel()
        MPI.Request.Waitall(self._recvs)
        while sends and not MPI.Request.Testall(sends) and time.monotonic() < deadline:
            time.sleep(0.002)
        for s in sends:
            if s != MPI.REQUEST_NULL:
                try:
                    s.Free()
                except MPI.Exception:
                    pass
        try:
            self.comm.Free()
        except MPI.Exception:
            pass


_PF_EXITING = 0x4  # the kernel's flag of a task inside exit()


def processes_gone(pids: Iterable[int]) -> List[int]:
    """The pids (of this PID namespace) that no longer run: absent, zombies, or exiting."""
    gone = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            gone.append(pid)
            continue
        if stat_says_gone(stat):
            gone.append(pid)
    return gone


def stat_says_gone(stat: bytes) -> bool:
    """From a /proc/<pid>/stat line: a zombie, or a process already inside exit(). A
    process killed with SIGKILL frees its memory before it becomes a zombie; a peer
    reading from it then (MPICH's process_vm_readv) fails with ESRCH while its state
    still reads R or D, and only the exiting flag says it is going."""
    try:
        fields = stat.rsplit(b")", 1)[1].split()
        state, flags = fields[0], int(fields[6])
    except (IndexError, ValueError):
        return True
    return state in (b"Z", b"X") or bool(flags & _PF_EXITING)
