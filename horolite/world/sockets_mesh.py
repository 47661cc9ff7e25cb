"""Point-to-point messages between the ranks of a job started without MPI.

One authenticated TCP connection joins each pair of ranks (set up in sockets.py). A
reader thread per connection takes every message as it comes, so a sender never
waits on its peer's progress and two ranks sending to each other cannot deadlock;
a message meets a posted receive in posting order, or waits in a queue for one, as
MPI's matching does (per communicator context, source and tag, never overtaking).
Large messages land straight in the posted receive's buffer. A connection that
closes fails the receives waiting on it with LinkLost naming the peer.

Between two generations of an elastic job a connection may be kept (kept_links.py):
each side ends its messages of the old world with a FENCE, and the reader stops there,
so nothing of an older world is ever read into a newer one.
"""
from __future__ import annotations

import collections
import logging
import socket
import struct
import threading
import time
from typing import Callable, Deque, Dict, List, Optional, Tuple

from ..failure.links import LinkLost
from ..transport.tcp_hello import settle
from .requests import ANY_SOURCE, RecvRequest, Request

__all__ = ["Mesh", "HEADER", "close_socket", "read_into"]

_log = logging.getLogger("horolite.world")

HEADER = struct.Struct("<Qqq")  # communicator context, tag, payload bytes
# The largest message a header may announce: above any one tensor a job sends (a model
# broadcast whole), and small enough that a garbled header is named, not allocated.
MAX_MESSAGE = 64 << 30
FENCE = (1 << 64) - 1  # (a context no communicator has: "nothing more of this world")
# How long leaving a world waits for a send to a peer already under way before it gives
# that connection up instead of keeping it (a peer that stopped reading).
FENCE_SECONDS = 1.0


class Mesh:
    """This rank's connections to every other rank of the job: sends, receives, losses."""

    def __init__(self, rank: int, size: int, socks: Dict[int, socket.socket],
                 where: Callable[[int], str]):
        self.rank, self.size, self.where = rank, size, where
        self._socks = dict(socks)
        self._send_locks = {q: threading.Lock() for q in socks}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self.version = 0
        self._posted: List[RecvRequest] = []
        self._arrived: Dict[Tuple[int, int, int], Deque[bytes]] = collections.defaultdict(
            collections.deque)
        self.lost: Dict[int, LinkLost] = {}
        self._closing = False
        self._readers = []
        self._fenced: set = set()  # peers whose FENCE was read: they left this world
        self._reader_ended = {q: threading.Event() for q in self._socks}
        for q, sock in self._socks.items():
            settle(sock)  # (no timeout: a quiet peer is not a lost one; keepalives)
            t = threading.Thread(target=self._read, args=(q, sock), daemon=True,
                                 name=f"horolite-world-recv-{rank}-from-{q}")
            t.start()
            self._readers.append(t)

    # -- waiting --
    def wait_change(self, version: int, timeout: float = 0.05) -> None:
        with self._changed:
            if self.version == version:
                self._changed.wait(timeout)

    def _bump(self) -> None:  # (under the lock)
        self.version += 1
        self._changed.notify_all()

    # -- sending --
    def send(self, context: int, dest: int, tag: int, data) -> None:
        view = memoryview(data).cast("B") if not isinstance(data, bytes) else data
        if dest == self.rank:
            self._deliver(context, dest, tag, bytes(view))
            return
        if dest in self.lost:
            raise self.lost[dest]
        sock = self._socks.get(dest)
        if sock is None:
            raise ValueError(f"rank {self.rank} has no connection to rank {dest}")
        try:
            with self._send_locks[dest]:
                if self._closing:  # (under the lock: nothing follows a FENCE)
                    raise LinkLost(f"rank {self.rank} left this world", [dest])
                sock.sendall(HEADER.pack(context, tag, len(view)))
                if len(view):
                    sock.sendall(view)
        except LinkLost:
            raise
        except BaseException as e:  # (a send cut off mid-frame: the stream is garbled)
            why = str(e) or type(e).__name__
            if not isinstance(e, OSError):
                why = f"{type(e).__name__}: {why}"
            error = self._lose(dest, f"sending failed: {why}")
            if not isinstance(e, OSError):
                raise
            raise error from None

    # -- receiving --
    def post(self, req: RecvRequest) -> RecvRequest:
        with self._lock:
            for key in self._keys_for(req):
                queue = self._arrived.get(key)
                if queue:
                    data = queue.popleft()
                    if not queue:
                        del self._arrived[key]
                    self._fill(req, key[1], data)
                    self._bump()
                    return req
            if req.want != ANY_SOURCE and req.want in self.lost:
                req.error, req.done = self.lost[req.want], True
                return req
            self._posted.append(req)
        return req

    def _keys_for(self, req: RecvRequest):
        if req.want != ANY_SOURCE:
            return [(req.context, req.want, req.tag)]
        return [k for k in list(self._arrived) if k[0] == req.context and k[2] == req.tag]

    def cancel(self, req: Request) -> None:
        with self._lock:
            if req in self._posted:
                self._posted.remove(req)
                req.done = True
                self._bump()

    def _fill(self, req: RecvRequest, source: int, data: bytes) -> None:
        if req.view is None:
            req.data = data
        else:
            if len(data) > len(req.view):
                req.error = ValueError(f"a message of {len(data)} bytes from rank {source} "
                                       f"for a receive of {len(req.view)} (tag {req.tag})")
            else:
                req.view[:len(data)] = data
        req.source, req.count, req.done = source, len(data), True

    def _claim(self, context: int, source: int, tag: int) -> Optional[RecvRequest]:
        for req in self._posted:
            if req.matches(context, source, tag):
                self._posted.remove(req)
                return req
        return None

    def _deliver(self, context: int, source: int, tag: int, data: bytes) -> None:
        with self._lock:
            req = self._claim(context, source, tag)
            if req is None:
                self._arrived[(context, source, tag)].append(data)
            else:
                self._fill(req, source, data)
            self._bump()

    def _read(self, q: int, sock: socket.socket) -> None:
        header = bytearray(HEADER.size)
        req = None  # the receive the latest message was claimed for (done once complete)
        try:
            while True:
                if not read_into(sock, memoryview(header)):
                    raise ConnectionResetError("closed by the peer")
                context, tag, n = HEADER.unpack(header)
                if context == FENCE and n == 0:
                    self._fenced.add(q)
                    self._lose(q, "it left for the next generation of the world")
                    return
                if not 0 <= n <= MAX_MESSAGE:
                    raise ValueError(f"a garbled header ({n} bytes)")
                with self._lock:
                    req = self._claim(context, q, tag)
                if req is not None and req.view is not None and n <= len(req.view):
                    if n and not read_into(sock, req.view[:n]):
                        raise ConnectionResetError("closed by the peer inside a message")
                    with self._lock:
                        req.source, req.count, req.done = q, n, True
                        self._bump()
                    continue
                data = bytearray(n)
                if n and not read_into(sock, memoryview(data)):
                    raise ConnectionResetError("closed by the peer inside a message")
                with self._lock:  # (kept as read: no second copy)
                    if req is None:
                        req = self._claim(context, q, tag)
                    if req is None:
                        self._arrived[(context, q, tag)].append(data)
                    else:
                        self._fill(req, q, data)
                    self._bump()
        except BaseException as e:  # (any failure of the reader fails the peer's receives)
            if not self._closing:
                why = str(e) or type(e).__name__
                if not isinstance(e, (OSError, ValueError)):
                    why = f"its reader failed ({type(e).__name__}: {why})"
                    _log.error("rank %d: the reader of %s failed", self.rank, self.where(q),
                               exc_info=True)
                error = self._lose(q, why)
                if req is not None and not req.done:  # (claimed, so not among the posted
                    with self._lock:                  # receives that _lose fails)
                        req.error, req.done = error, True
                        self._bump()
        finally:
            self._reader_ended[q].set()

    def _lose(self, q: int, why: str) -> LinkLost:
        with self._lock:
            if q in self.lost:
                return self.lost[q]
            error = LinkLost(f"the connection to {self.where(q)} closed: {why}", [q])
            self.lost[q] = error
            for req in [r for r in self._posted if r.want == q]:
                self._posted.remove(req)
                req.error, req.done = error, True
            self._bump()
        _log.debug("rank %d: %s", self.rank, error)
        return error

    def park(self) -> Dict[int, Tuple[socket.socket, Callable[[float], bool]]]:
        """Leave this world, keeping the connections still open: {peer: (socket,
        fenced(deadline))}, where fenced says, once the peer's FENCE was read (waiting
        until `deadline`, time.monotonic()), that the socket is ready for a next world.
        The others are closed."""
        self._closing = True
        kept = {}
        for q, sock in self._socks.items():
            if q in self.lost and q not in self._fenced:
                close_socket(sock)
                continue
            lock = self._send_locks[q]
            if not lock.acquire(timeout=FENCE_SECONDS):  # a send to it is stuck: not kept
                close_socket(sock)
                continue
            try:
                # A limit on this send alone (a partitioned peer's full buffer); not
                # settimeout(), which the reader's recv on the same socket would obey.
                _send_limit(sock, FENCE_SECONDS)
                sock.sendall(HEADER.pack(FENCE, 0, 0))
                _send_limit(sock, 0)
            except OSError:
                close_socket(sock)
                continue
            finally:
                lock.release()

            def fenced(deadline: float, q=q) -> bool:
                self._reader_ended[q].wait(max(0.0, deadline - time.monotonic()))
                return q in self._fenced
            kept[q] = (sock, fenced)
        return kept

    def close(self) -> None:
        self._closing = True
        for sock in self._socks.values():
            close_socket(sock)


def _send_limit(sock: socket.socket, seconds: float) -> None:
    """SO_SNDTIMEO: a blocked send gives up after `seconds` (0: never)."""
    whole = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                    struct.pack("ll", whole, int((seconds - whole) * 1e6)))


def close_socket(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def read_into(sock: socket.socket, view: memoryview) -> bool:
    """Fill `view` from `sock`; False when the peer closed first."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
        if n == 0:
            return False
        got += n
    return True
