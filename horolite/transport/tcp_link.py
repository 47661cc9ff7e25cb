"""Messages over horolite's own TCP connections, with threads that sleep in the kernel.

MPI over TCP moves bytes only inside MPI calls, so a rank waiting for a piece of the
ring must keep calling MPI: across hosts every wait polled, and waiting cost as much
CPU as computing. Here each connection (a "stream") has a sender thread blocked on
its queue and a receiver thread blocked in recv_into(); they release the GIL while
the kernel moves the bytes, straight from and into the ring's NumPy buffers. The
thread that waits for a request sleeps on a condition variable that a completion
notifies, waking only for completions and every WATCH_EVERY seconds to call the
collective watch (failure notices, heartbeats, stall reports).

A message is a header (link id, tag, sequence number, length) and its bytes. Small
ones (the control exchange, a small allreduce) take an express connection of their own,
so they never wait behind the data queued on the others.
Receives are matched per (link, tag) in the order they were posted, as MPI matches
them, through the sequence number: messages of one peer may travel on several
streams (a link that one stream cannot fill) and arrive in any order. A message
that arrives before its receive is posted is kept (unexpected) until it is.

A connection that closes without the peer's goodbye, or fails, fails every request
on that peer with LinkLost naming its rank and host, and every later one (logged at
debug level: the runtime that acts on it says so at ERROR, runtime/job_end.py). A rank
whose job failed ends its connections without a goodbye (`abort`), failing its peers'
requests at once.
"""
from __future__ import annotations

import itertools
import logging
import os
import queue
import socket
import struct
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..failure.links import LinkLost
from .tcp_io import check_contiguous as _check_contiguous, recv_exactly as _recv_exactly
from .tcp_io import send_all as _send_all

__all__ = ["Request", "Peer", "TcpLink", "WATCH_EVERY"]

_log = logging.getLogger("horolite.transport.tcp_link")

# link id, tag, sequence number, payload length
HEADER = struct.Struct("<HiIQ")
# Sequence numbers count per (link, tag) modulo 2**32, on both sides alike: a run of any
# length never outgrows the field, and fewer than 2**32 messages of one key are ever in
# flight at once.
SEQ_MASK = 0xFFFFFFFF
# No message is this long: a header that says so is garbage (a stream out of step), not
# a reason to allocate it.
MAX_MESSAGE = 1 << 40
LINK_IDS = range(0, 256)
# Messages up to this size (the control exchange's, a small allreduce's pieces) travel on
# a peer's express connection, never queued behind a megabyte piece of a data stream.
EXPRESS_BYTES = 16 << 10
BYE = -2  # the tag of the goodbye sent on every stream by a rank that closes in order
# While a wait lasts, the collective watch is called this often (it hears other ranks'
# failure notices, keeps the heartbeat going, reports stalls): the only timed wake-up.
WATCH_EVERY = 0.1


class Request:
    """One send or receive: done (and its error, if it failed) set by an I/O thread."""
    __slots__ = ("buf", "peer", "done", "error")

    def __init__(self, buf, peer: int):
        self.buf, self.peer = buf, peer
        self.done = False
        self.error: Optional[BaseException] = None

    def Test(self) -> bool:
        """Whether it completed (raises its error if it failed): hierarchical.drive's call."""
        if self.error is not None:
            raise self.error
        return self.done


class _Unexpected:
    __slots__ = ("data", "complete", "waiting")

    def __init__(self, length: int):
        self.data = np.empty(length, np.uint8)  # (not zero-filled: recv_into fills it)
        self.complete = False
        self.waiting: Optional[Request] = None


class Peer:
    """The streams to one peer rank: a sender and a receiver thread each."""

    def __init__(self, me: int, job_rank: int, where: str, socks: Sequence[socket.socket],
                 changed: threading.Condition, on_lost: Callable[[LinkLost], None],
                 express: bool = False):
        """me: this rank; job_rank: the peer's; where: 'rank 1 (host node2)'; express: the
        last of `socks` carries small messages alone (EXPRESS_BYTES), the rest data."""
        self.me, self.job_rank, self.where = me, job_rank, where
        self._socks = list(socks)
        self._changed = changed  # notified on every completion (the mesh's one condition)
        self._on_lost = on_lost
        self._lock = threading.Lock()
        self._posted: Dict[Tuple[int, int, int], Request] = {}
        self._unexpected: Dict[Tuple[int, int, int], _Unexpected] = {}
        self._send_seq: Dict[Tuple[int, int], int] = {}
        self._recv_seq: Dict[Tuple[int, int], int] = {}
        self._queues = [queue.SimpleQueue() for _ in self._socks]
        data = len(self._socks) - 1 if express and len(self._socks) > 1 else len(self._socks)
        self._express = data if data < len(self._socks) else None
        self._next_stream = itertools.cycle(range(data))
        self.closing = False
        self.error: Optional[LinkLost] = None
        self.threads: List[threading.Thread] = []
        for i, sock in enumerate(self._socks):
            for role, target in (("send", self._sender), ("recv", self._receiver)):
                t = threading.Thread(target=target, args=(i,), daemon=True,
                                     name=f"horolite-tcp-{role}-{job_rank}.{i}")
                t.start()
                self.threads.append(t)

    # ---- caller side ----
    def isend(self, link_id: int, tag: int, buf: np.ndarray) -> Request:
        _check_contiguous(buf)
        req = Request(buf, self.job_rank)
        with self._lock:
            key = (link_id, tag)
            seq = self._send_seq.get(key, 0)
            self._send_seq[key] = (seq + 1) & SEQ_MASK
            if self.error is not None:
                req.error, req.done = self.error, True
                return req
        stream = (self._express if self._express is not None and buf.nbytes <= EXPRESS_BYTES
                  else next(self._next_stream))
        self._queues[stream].put((HEADER.pack(link_id, tag, seq, buf.nbytes), req))
        return req

    def irecv(self, link_id: int, tag: int, buf: np.ndarray) -> Request:
        _check_contiguous(buf)
        req = Request(buf, self.job_rank)
        with self._lock:
            key = (link_id, tag)
            seq = self._recv_seq.get(key, 0)
            self._recv_seq[key] = (seq + 1) & SEQ_MASK
            full = (link_id, tag, seq)
            early = self._unexpected.get(full)
            if early is not None:
                if not early.complete:
                    early.waiting = req  # its receiver thread hands it over when complete
                    return req
                del self._unexpected[full]
            elif self.error is not None:
                req.error, req.done = self.error, True
                return req
            else:
                self._posted[full] = req
                return req
        self._deliver(req, early.data)
        return req

    # ---- the I/O threads ----
    def _sender(self, i: int) -> None:
        try:
            self._send_loop(i)
        except BaseException as e:  # never die in silence: the peer's requests fail instead
            self._lost(f"its sending thread failed: {e!r}")

    def _send_loop(self, i: int) -> None:
        sock, inbox = self._socks[i], self._queues[i]
        while True:
            item = inbox.get()  # blocks in the kernel (a lock's futex) until there is work
            if item is None:
                return
            header, req = item
            if self.error is not None:
                self._finish(req, self.error)
                continue
            try:
                _send_all(sock, header, req.buf)
            except OSError as e:
                self._lost(f"sending to it failed ({e.strerror or e})")
                self._finish(req, self.error or self._closed())
                continue
            except BaseException as e:
                self._lost(f"its sending thread failed: {e!r}")
                self._finish(req, self.error or self._closed())
                return
            self._finish(req, None)

    def _receiver(self, i: int) -> None:
        sock = self._socks[i]
        header = bytearray(HEADER.size)
        said_bye = False
        try:
            while True:
                if not _recv_exactly(sock, memoryview(header)):
                    if said_bye or self.closing:
                        return  # the peer said goodbye on this stream: an orderly end
                    self._lost("its connection closed: its process ended or its host is "
                               "unreachable")
                    return
                link_id, tag, seq, length = HEADER.unpack(header)
                if tag == BYE:
                    said_bye = True
                    continue
                if link_id not in LINK_IDS or length > MAX_MESSAGE:
                    self._lost(f"it sent a garbled header (link {link_id}, {length} bytes)")
                    return
                self._receive(sock, (link_id, tag, seq), length)
        except OSError as e:
            if not self.closing:
                self._lost(f"its connection failed ({e.strerror or e})")
        except BaseException as e:  # never die in silence: the peer's requests fail instead
            self._lost(f"its receiving thread failed: {e!r}")

    def _receive(self, sock: socket.socket, key, length: int) -> None:
        with self._lock:
            req = self._posted.pop(key, None)
            early = None
            if req is None:
                early = self._unexpected[key] = _Unexpected(length)
        if req is not None:
            view = memoryview(req.buf).cast("B")
            if view.nbytes != length:  # a protocol error: keep the stream in step, fail it
                _recv_exactly(sock, memoryview(bytearray(length)))
                self._finish(req, RuntimeError(
                    f"a message of {length} bytes from {self.where} does not fit the "
                    f"{view.nbytes} bytes posted for it (link {key[0]}, tag {key[1]})"))
                return
            try:
                if not _recv_exactly(sock, view):
                    raise ConnectionResetError("the connection closed inside a message")
            except OSError:
                self._lost("its connection closed inside a message")
                self._finish(req, self.error or self._closed())
                raise
            self._finish(req, None)
            return
        if not _recv_exactly(sock, memoryview(early.data)):
            raise ConnectionResetError("the connection closed inside a message")
        with self._lock:
            early.complete = True
            waiting = early.waiting
            if waiting is not None:
                del self._unexpected[key]
        if waiting is not None:
            self._deliver(waiting, early.data)

    def _deliver(self, req: Request, data: bytearray) -> None:
        view = memoryview(req.buf).cast("B")
        if view.nbytes != len(data):
            self._finish(req, RuntimeError(
                f"a message of {len(data)} bytes from {self.where} does not fit the "
                f"{view.nbytes} bytes posted for it"))
            return
        view[:] = data
        self._finish(req, None)

    def _finish(self, req: Request, error: Optional[BaseException]) -> None:
        with self._changed:
            req.error = error
            req.done = True
            self._changed.notify_all()

    def _closed(self) -> LinkLost:
        """The error of a request cut short by this rank's own close."""
        return self.error or LinkLost(f"the connection to {self.where} was closed by this "
                                      "rank while a message was under way", [self.job_rank],
                                      own=True)

    def _lost(self, why: str) -> None:
        with self._lock:
            if self.error is not None or self.closing:
                return
            self.error = LinkLost(f"the connection to {self.where} closed: {why}",
                                  [self.job_rank], own=True)
            pending = self._take_pending()
        _log.debug("rank %d: %s", self.me, self.error)
        self._on_lost(self.error)  # (first: whoever a failed request wakes finds the mesh's)
        for req in pending:
            self._finish(req, self.error)
        for q in self._queues:
            q.put(None)  # (senders end; what they still hold fails)

    def _take_pending(self) -> List[Request]:
        """(under the lock) The posted receives, which no message will complete now."""
        pending = list(self._posted.values()) + [u.waiting for u in self._unexpected.values()
                                                 if u.waiting is not None]
        self._posted.clear()
        return pending

    def abort(self) -> None:
        """This rank's job failed: end every stream now, without a goodbye (the peer's
        requests fail at once, and this rank's pending ones too), quietly."""
        with self._lock:
            self.closing = True
            self.error = self.error or LinkLost(
                f"the connection to {self.where} was closed: this rank's job failed",
                [self.job_rank], own=True)
            pending = self._take_pending()
        for sock, q in zip(self._socks, self._queues):
            try:
                sock.shutdown(socket.SHUT_RDWR)  # (the connection, whoever else holds it)
            except OSError:
                pass
            sock.close()
            q.put(None)
        for req in pending:
            self._finish(req, self.error)

    def forget(self) -> None:
        """In a child forked from this process: close its copies of the sockets, leaving
        the connections to the parent (a shutdown would end them for both)."""
        for sock in self._socks:
            fd = sock.detach()  # (-1 once closed: an aborted mesh's)
            if fd >= 0:
                os.close(fd)

    def close(self, grace: float) -> None:
        """Goodbye on every stream, then wait up to `grace` s for the peer's, then close."""
        for i in range(len(self._socks)):
            self._queues[i].put((HEADER.pack(0, BYE, 0, 0), Request(np.empty(0, np.uint8), -1)))
            self._queues[i].put(None)
        deadline = time.monotonic() + grace
        for t in self.threads:
            if t.name.startswith("horolite-tcp-send"):
                t.join(max(0.0, deadline - time.monotonic()))
        for sock in self._socks:
            try:
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        for t in self.threads:
            if t.name.startswith("horolite-tcp-recv"):
                t.join(max(0.0, deadline - time.monotonic()))
        self.closing = True
        for sock in self._socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


class TcpLink:
    """What transport/ring.py's Ring drives: messages to the ranks of one ring (`ranks`,
    their job ranks) over the mesh's peers, and waits that sleep until a completion."""
    buffers_early = True  # a message ahead of its receive is held in memory: Ring paces

    def __init__(self, mesh, link_id: int, ranks: Sequence[int], waiter):
        """waiter: the transport's MPI waiter, whose `watch` is called while a wait lasts."""
        self.mesh, self.link_id, self.ranks = mesh, link_id, list(ranks)
        self.rank = self.ranks.index(mesh.job_rank)
        self.size = len(self.ranks)
        self.right = (self.rank + 1) % self.size
        self.left = (self.rank - 1) % self.size
        self._waiter = waiter
        self.wakeups = 0  # returns from the condition's wait: what the tests count

    def _peer(self, q: int) -> Peer:
        return self.mesh.peers[self.ranks[q]]

    def isend(self, buf: np.ndarray, dest: int = -1, tag: int = -1) -> Request:
        return self._peer(self.right if dest < 0 else dest).isend(self.link_id, tag, buf)

    def irecv(self, buf: np.ndarray, source: int = -1, tag: int = -1) -> Request:
        return self._peer(self.left if source < 0 else source).irecv(self.link_id, tag, buf)

    def sendrecv(self, send: np.ndarray, recv: np.ndarray, dest: int = -1, source: int = -1):
        self.wait_all([self.irecv(recv, source), self.isend(send, dest)])

    def wait(self, req: Request) -> None:
        self.wait_any([req])

    def wait_all(self, reqs) -> None:
        for req in reqs:
            self.wait_any([req])

    def guard(self) -> None:
        """(the MPI waiter's; nothing to look at before a send on these connections)"""

    def wait_any(self, reqs: Sequence[Request], peer: int = -1) -> int:
        """Sleep until one of `reqs` completes; its index (raises its error if it failed)."""
        changed = self.mesh.changed
        start = time.monotonic()
        next_watch = start + WATCH_EVERY
        with changed:
            while True:
                for i, req in enumerate(reqs):
                    if req.done:
                        break
                else:
                    i = -1
                if i >= 0:
                    break
                now = time.monotonic()
                if now >= next_watch:  # every WATCH_EVERY, however busy the other links are
                    next_watch = now + WATCH_EVERY
                    changed.release()  # (the watch may take long: no I/O thread waits on us)
                    try:
                        self._watch(now - start, reqs[0].peer)
                    finally:
                        changed.acquire()
                    continue
                changed.wait(next_watch - now)
                self.wakeups += 1
        if reqs[i].error is not None:
            raise reqs[i].error
        return i

    def _watch(self, waited: float, peer: int) -> None:
        watch = getattr(self._waiter, "watch", None)
        if self.mesh.lost is not None:
            raise self.mesh.lost
        if watch is not None:
            watch(waited, peer)
