"""Whether a peer's TCP connection has closed, looked at before this rank sends to anyone.

MPICH's UCX network layer crashes the sending process (SIGSEGV inside MPI_Isend,
and in every collective that sends) once UCX has marked the endpoint of a peer on
another host as failed: a peer killed with SIGKILL, say, closes its sockets, UCX
notices at its next progress, and the next send to that peer dereferences a request
MPICH never made. A rank must never crash because a peer died, and nothing in MPI
tells it the peer is gone before that send. The kernel does: the peer's end of the
connection closed (POLLRDHUP), reset (POLLHUP/POLLERR), or the socket was closed by
UCX itself (POLLNVAL, a number now free or reused). So every send the background
thread makes is preceded by `check()`, one poll() with a zero timeout over this
process's TCP connections to peers (a few microseconds), which raises LinkLost
naming the peer instead. The connections are the ones whose far end is a peer's
listening address (every rank publishes its own at init) or whose near end is one
of this rank's: UCX listens on each interface address, which tells its sockets from
the launcher's (those listen on the wildcard address). Connections are made on first
use, so the list is refreshed every REFRESH_SECONDS.
"""
from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from typing import Dict, List, Optional, Sequence, Set, Tuple

__all__ = ["LinkWatch", "LinkLost", "REFRESH_SECONDS"]

_log = logging.getLogger("horolite.failure.links")

REFRESH_SECONDS = 0.1
_ESTABLISHED, _LISTEN = 1, 10  # tcpi_state
_GONE = select.POLLHUP | select.POLLERR | select.POLLNVAL | getattr(select, "POLLRDHUP", 0x2000)
Address = Tuple[str, int]


class LinkLost(Exception):
    """A connection to a peer on another host closed: sending to it would crash MPICH.
    `own`: one of horolite's own connections (transport/tcp_link.py), which MPI never
    uses, so MPI may still carry the news to the other ranks (runtime/job_end.py)."""

    def __init__(self, text: str, ranks: Sequence[int], own: bool = False):
        super().__init__(text)
        self.ranks = list(ranks)
        self.own = own


def _own_sockets() -> Dict[str, int]:
    """{socket inode: fd} of this process."""
    found = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found[target[8:-1]] = int(name)
    return found


def _tcp_table(inodes: Dict[str, int]) -> List[Tuple[Address, Address, int, int]]:
    """(local, remote, state, fd) of this process's TCP sockets among `inodes` ({inode: fd}).

    Asked of each socket (getsockname, getpeername, TCP_INFO), not read from
    /proc/net/tcp: that file walks every bucket of the kernel's connection table,
    milliseconds per read on a large machine, whatever this process owns."""
    rows = []
    for fd in inodes.values():
        sock = _borrow(fd)
        if sock is None:
            continue
        try:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                continue
            state = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]
            local = tuple(sock.getsockname()[:2])
            try:
                remote = tuple(sock.getpeername()[:2])
            except OSError:  # not connected (listening, or connecting)
                remote = ("", 0)
            rows.append((local, remote, state, fd))
        except OSError:
            continue
        finally:
            sock.close()
    return rows


def listening_addresses() -> List[Address]:
    """This process's listening TCP addresses bound to one interface (not the wildcard)."""
    wild = {"0.0.0.0", "::"}
    return sorted({local for local, _, state, _ in _tcp_table(_own_sockets())
                   if state == _LISTEN and local[0] not in wild})


class LinkWatch:
    """This rank's TCP connections to peers, and a cheap test that none has closed."""

    def __init__(self, comm, hostnames: Sequence[str]):
        """Collective over `comm` (the job's): every rank's listening addresses."""
        self.rank = comm.Get_rank()
        self.hostnames = list(hostnames)
        listeners = comm.allgather(listening_addresses())
        self._owner: Dict[Address, int] = {a: q for q, addrs in enumerate(listeners)
                                           for a in addrs if q != self.rank}
        self._mine: Set[int] = {port for _, port in listeners[self.rank]}
        self._by_ip: Dict[str, Set[int]] = {}
        here = self.hostnames[self.rank] if self.rank < len(self.hostnames) else None
        for q, addrs in enumerate(listeners):
            for ip, _ in addrs:
                # a loopback address is every host's: only this host's ranks reach it here
                if q != self.rank and (not _loopback(ip) or self.hostnames[q] == here):
                    self._by_ip.setdefault(ip, set()).add(q)
        self._links: Dict[int, Tuple[str, Address, List[int]]] = {}  # fd -> (inode, remote, ranks)
        self._poll = select.poll()
        # One look at a time: a process set's background thread shares the job's watch, and
        # two threads in one poll object's poll() is an error (RuntimeError).
        self._lock = threading.RLock()
        self._next_refresh = 0.0
        self.lost: Optional[LinkLost] = None  # the first closed link found
        self._unsafe: Set[int] = set()
        self._dead: Set[str] = set()  # inodes of links found closed
        self.refresh()

    def refresh(self) -> None:
        """Find connections made since the last look (UCX connects on first use)."""
        with self._lock:
            self._refresh()

    def _refresh(self) -> None:
        inodes = {inode: fd for inode, fd in _own_sockets().items()
                  if fd not in self._links and inode not in self._dead}
        by_fd = {fd: inode for inode, fd in inodes.items()}
        for local, remote, state, fd in _tcp_table(inodes):
            if state != _ESTABLISHED:
                continue
            if remote in self._owner:
                ranks = [self._owner[remote]]
            elif local[1] in self._mine and remote[0] in self._by_ip:
                ranks = sorted(self._by_ip[remote[0]])  # they connected: one of that host's
            else:
                continue
            self._links[fd] = (by_fd[fd], remote, ranks)
            self._poll.register(fd, _GONE)
        self._next_refresh = time.monotonic() + REFRESH_SECONDS

    @property
    def remote(self) -> bool:
        """Whether this rank has connections to watch (peers on other hosts)."""
        return bool(self._links)

    def check(self) -> None:
        """Raise LinkLost if a connection to a peer closed. Before every send."""
        if self.lost is None:
            self._look()
        if self.lost is not None:
            raise self.lost

    def unsafe(self) -> Set[int]:
        """Ranks this process must not send to (looked at now): those behind a closed link."""
        self._look()
        return set(self._unsafe)

    def _look(self) -> None:
        if not self._links and time.monotonic() < self._next_refresh:
            return
        with self._lock:
            self._look_locked()

    def _look_locked(self) -> None:
        for fd, _ in (self._poll.poll(0) if self._links else []):
            inode, remote, ranks = self._links[fd]
            try:
                same = os.readlink(f"/proc/self/fd/{fd}") == f"socket:[{inode}]"
            except OSError:
                same = False
            if same and not _closed(fd):
                continue
            self._poll.unregister(fd)
            del self._links[fd]
            self._dead.add(inode)  # not taken up again by a refresh while it lingers
            self._unsafe.update(ranks)
            if self.lost is None:
                self.lost = LinkLost(self._text(ranks, remote), ranks)
        if time.monotonic() >= self._next_refresh:
            self._refresh()

    def _text(self, ranks: List[int], remote: Address) -> str:
        host = self.hostnames[ranks[0]] if ranks and ranks[0] < len(self.hostnames) else remote[0]
        who = (f"rank {ranks[0]} (host {host})" if len(ranks) == 1 else
               f"one of ranks {', '.join(map(str, ranks))} (host {host})")
        return (f"the connection to {who} closed: its process ended or its host is "
                f"unreachable; rank {self.rank} stops sending to it")

    def close(self) -> None:
        for fd in list(self._links):
            try:
                self._poll.unregister(fd)
            except (KeyError, ValueError):
                pass
        self._links.clear()


def _loopback(ip: str) -> bool:
    return ip.startswith("127.") or ip in ("::1", "::ffff:127.0.0.1")


def _borrow(fd: int) -> Optional[socket.socket]:
    """A socket object on a duplicate of `fd` (closing it leaves `fd` open), or None."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        return socket.socket(fileno=dup)
    except (OSError, ValueError):
        os.close(dup)
        return None


def _closed(fd: int) -> bool:
    """Whether the connection on `fd` (one of UCX's: looked at, never read) has ended."""
    sock = _borrow(fd)
    if sock is None:
        return True
    try:
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            return True
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)
        return info[0] != _ESTABLISHED
    except OSError:
        return True
    finally:
        sock.close()
