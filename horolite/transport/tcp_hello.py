"""The hello that opens each of horolite's TCP connections: two-way, authenticated, and
deaf to strangers.

While set-up listens, anything may connect: a port scanner, a load balancer's health
check, another job on a shared port range, a rank that dialled the wrong host. None of
them may fail or join the job. So every accepted connection says its hello in its own
thread, under a limit of its own (HELLO_SECONDS), and a connection that stays silent,
resets, or says anything but a valid hello is dropped (logged once at debug level)
while set-up goes on. Both sides prove they hold the job's secret, a key rank 0 drew
and the job's own communicator carried (never these sockets), with an HMAC over both
sides' nonces and ranks, so the secret never travels and a recorded hello is worth
nothing. The connecting rank learns whom it reached: a wrong address fails in
milliseconds, and the next address is tried.

    connector -> acceptor   HELLO  magic, version, its rank, the rank it wants, stream, nonce
    acceptor  -> connector  REPLY  magic, version, its rank, the connector's, stream, nonce, MAC
    connector -> acceptor   PROOF  MAC
    acceptor  -> connector  ACK    one byte: the stream is this job's (a duplicate is refused)
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import selectors
import socket
import struct
import threading
import time
from typing import Dict, List, Optional, Sequence

__all__ = ["HELLO_SECONDS", "HelloRefused", "Acceptor", "connect"]

_log = logging.getLogger("horolite.transport.tcp")

MAGIC = 0x686C7463  # "hltc"
VERSION = 2
HELLO = struct.Struct("<IIiii16s")
REPLY = struct.Struct("<IIiii16s32s")
MAC_BYTES = 32
ACK = b"\x01"
# How long one accepted connection may take to say its hello: a rank's arrives within
# microseconds of its connect (seconds on a machine loaded many times over); a silent
# stranger holds only its own thread this long.
HELLO_SECONDS = 10.0


class HelloRefused(Exception):
    """The far end is not the rank wanted, or not of this job."""


def _mac(key: bytes, side: bytes, hello: bytes, reply_head: bytes) -> bytes:
    return hmac.new(key, side + hello + reply_head, hashlib.sha256).digest()


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise HelloRefused(f"it closed the connection after {len(data)} of {n} bytes")
        data += chunk
    return data


def connect(addr: str, port: int, rank: int, want: int, stream: int, key: bytes,
            timeout: float) -> socket.socket:
    """A connection to rank `want` at addr:port whose far end proved it is that rank of
    this job. OSError (refused, unreachable, timed out) or HelloRefused."""
    sock = socket.create_connection((addr, port), timeout=timeout)
    try:
        sock.settimeout(min(timeout, HELLO_SECONDS) if timeout > 0 else HELLO_SECONDS)
        hello = HELLO.pack(MAGIC, VERSION, rank, want, stream, os.urandom(16))
        sock.sendall(hello)
        try:
            reply = _recv_exactly(sock, REPLY.size)
        except socket.timeout:
            raise HelloRefused(f"no hello answered within {sock.gettimeout():g} s "
                               "(not a horolite rank?)") from None
        magic, version, who, whom, s, _, mac = REPLY.unpack(reply)
        if magic != MAGIC or version != VERSION:
            raise HelloRefused("not a horolite rank of this version")
        if not hmac.compare_digest(mac, _mac(key, b"A", hello, reply[:-MAC_BYTES])):
            raise HelloRefused("a rank of another job")
        if who != want or whom != rank or s != stream:
            raise HelloRefused(f"rank {who} answered, not rank {want}")
        sock.sendall(_mac(key, b"C", hello, reply[:-MAC_BYTES]))
        if sock.recv(1) != ACK:
            raise HelloRefused("it refused the stream (connected already, or set-up ended)")
    except socket.timeout:
        sock.close()
        raise HelloRefused("it stopped answering during the hello") from None
    except BaseException:
        sock.close()
        raise
    return sock


class Acceptor:
    """Takes the connections of the ranks below this one (`expected`: how many streams from
    each) on `listeners`, each hello in a thread of its own; strangers are dropped."""

    def __init__(self, listeners: Sequence[socket.socket], rank: int, expected: Dict[int, int],
                 key: bytes):
        self.rank, self.key = rank, key
        self.slots: Dict[int, List[Optional[socket.socket]]] = {
            q: [None] * n for q, n in expected.items()}
        self.missing = sum(expected.values())
        self.dropped = 0
        self.complete = threading.Event()
        if not self.missing:
            self.complete.set()
        self._listeners = list(listeners)
        self._lock = threading.Lock()
        self._open: List[socket.socket] = []
        self._stop = False
        self._thread = threading.Thread(target=self._accept, daemon=True,
                                        name=f"horolite-tcp-accept-{rank}")
        self._thread.start()

    def _accept(self) -> None:
        with selectors.DefaultSelector() as sel:
            for listener in self._listeners:
                listener.setblocking(False)
                sel.register(listener, selectors.EVENT_READ)
            while not self._stop and not self.complete.is_set():
                for key, _ in sel.select(0.05):
                    try:
                        sock, peer = key.fileobj.accept()
                    except OSError:
                        continue  # (closed by close(), or the client already gone)
                    sock.setblocking(True)
                    with self._lock:
                        self._open.append(sock)
                    threading.Thread(target=self._hello, args=(sock, peer), daemon=True,
                                     name=f"horolite-tcp-hello-{self.rank}").start()

    def _hello(self, sock: socket.socket, peer) -> None:
        try:
            sock.settimeout(HELLO_SECONDS)
            hello = _recv_exactly(sock, HELLO.size)
            magic, version, q, target, s, _ = HELLO.unpack(hello)
            if magic != MAGIC or version != VERSION:
                raise HelloRefused("not a horolite hello")
            if target != self.rank:
                raise HelloRefused(f"it wanted rank {target}")
            if q not in self.slots or not 0 <= s < len(self.slots[q]):
                raise HelloRefused(f"rank {q} stream {s} is not one this rank takes")
            head = REPLY.pack(MAGIC, VERSION, self.rank, q, s, os.urandom(16),
                              b"\0" * MAC_BYTES)[:-MAC_BYTES]
            sock.sendall(head + _mac(self.key, b"A", hello, head))
            proof = _recv_exactly(sock, MAC_BYTES)
            if not hmac.compare_digest(proof, _mac(self.key, b"C", hello, head)):
                raise HelloRefused("it does not hold this job's key")
            with self._lock:
                if self._stop or self.slots[q][s] is not None:
                    raise HelloRefused(f"rank {q} stream {s} is already connected")
                sock.sendall(ACK)
                self.slots[q][s] = sock
                self._open.remove(sock)
                self.missing -= 1
                if not self.missing:
                    self.complete.set()
        except (OSError, HelloRefused, struct.error) as e:
            why = "silent" if isinstance(e, socket.timeout) else str(e) or type(e).__name__
            with self._lock:
                self.dropped += 1
                if sock in self._open:
                    self._open.remove(sock)
            _log.debug("rank %d: set-up dropped a connection from %s:%s: %s", self.rank,
                       peer[0], peer[1], why)
            sock.close()

    def wait(self, deadline: float) -> bool:
        """Whether every expected stream arrived by `deadline` (time.monotonic())."""
        return self.complete.wait(max(0.0, deadline - time.monotonic()))

    def waiting_for(self) -> List[int]:
        with self._lock:
            return sorted(q for q, pair in self.slots.items() if None in pair)

    def close(self) -> None:
        """Stop listening; strangers still saying nothing are cut off."""
        with self._lock:
            self._stop = True
            pending, self._open = self._open, []
        self._thread.join()
        for sock in pending:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # (wakes its hello thread out of recv)
            except OSError:
                pass
        for sock in pending + self._listeners:
            sock.close()

    def taken(self) -> Dict[int, List[socket.socket]]:
        """The streams that arrived (call after close())."""
        return self.slots
