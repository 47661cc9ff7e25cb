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
from typing import Callable, Dict, List, Optional, Sequence, Tuple

__all__ = ["HELLO_SECONDS", "ATTEMPT_SECONDS", "HelloRefused", "Unreachable", "Acceptor",
           "connect", "dial", "settle"]

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
# How long one connect to one address may take before the next address is tried: a
# reachable address answers (or refuses) within milliseconds, one that drops packets never.
ATTEMPT_SECONDS = 3.0
# Once established, a connection blocks without a timeout: a quiet peer (a paused VM, a
# debugger, a long evaluation on one rank) is not a lost one. Keepalives (and a limit on
# unacknowledged data) end a connection whose far host vanished without a FIN after
# HALF_OPEN_SECONDS, longer than a link outage a job survives (the multi-host tests take
# links down for 20 and 75 s; inside a collective the stall inspector speaks first).
HALF_OPEN_SECONDS = 180
# Socket buffers asked for: one 1 MiB piece in flight several times over (Gloo asks up
# to 32 MiB). Asked only where the kernel's maximum allows it: an explicit size below
# that maximum would turn the kernel's own tuning (up to tcp_rmem's top) off.
BUFFER_BYTES = 8 << 20
# Connections accepted that have not yet proved the key: beyond this many, the oldest
# is cut off, so strangers hold at most this many threads and descriptors.
MAX_UNPROVEN = 64


class HelloRefused(Exception):
    """The far end is not the rank wanted, or not of this job."""


class Unreachable(OSError):
    """No address of a peer answered its hello by the deadline; `tried`: for each address,
    the latest attempt's error."""

    def __init__(self, tried: Dict[str, BaseException]):
        super().__init__("; ".join(f"{a}: {reason(e)}" for a, e in tried.items()))
        self.tried = tried


def reason(e: BaseException) -> str:
    """Why one attempt failed, in words."""
    if isinstance(e, socket.timeout):
        return "no answer (timed out)"
    return getattr(e, "strerror", None) or str(e) or type(e).__name__


def settle(sock: socket.socket) -> socket.socket:
    """An established connection's settings, the same for every connection horolite
    keeps: blocking without a timeout, no Nagle, keepalives, large buffers."""
    sock.settimeout(None)
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return sock
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 15), ("TCP_KEEPCNT", 8),
                       ("TCP_USER_TIMEOUT", 1000 * HALF_OPEN_SECONDS)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)
    for opt, limit in ((socket.SO_SNDBUF, "wmem_max"), (socket.SO_RCVBUF, "rmem_max")):
        try:
            with open(f"/proc/sys/net/core/{limit}") as f:
                allowed = int(f.read())
        except (OSError, ValueError):
            continue
        if allowed >= BUFFER_BYTES:
            sock.setsockopt(socket.SOL_SOCKET, opt, BUFFER_BYTES)
    return sock


def _mac(key: bytes, side: bytes, hello: bytes, reply_head: bytes) -> bytes:
    return hmac.new(key, side + hello + reply_head, hashlib.sha256).digest()


def _recv_exactly(sock: socket.socket, n: int, deadline: Optional[float] = None) -> bytes:
    """n bytes; with a `deadline` (time.monotonic()), all of them by then, however slowly
    they trickle (socket.timeout otherwise)."""
    data = b""
    while len(data) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("timed out")
            sock.settimeout(left)
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise HelloRefused(f"it closed the connection after {len(data)} of {n} bytes")
        data += chunk
    return data


def connect(addr: str, port: int, rank: int, want: int, stream: int, key: bytes,
            timeout: float, connect_seconds: Optional[float] = None) -> socket.socket:
    """A connection to rank `want` at addr:port whose far end proved it is that rank of
    this job, settled (settle()). OSError (refused, unreachable, timed out) or
    HelloRefused. `connect_seconds`: the limit on the TCP connect alone (else `timeout`)."""
    sock = socket.create_connection(
        (addr, port), timeout=timeout if connect_seconds is None else connect_seconds)
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
        settle(sock)
    except socket.timeout:
        sock.close()
        raise HelloRefused("it stopped answering during the hello") from None
    except BaseException:
        sock.close()
        raise
    return sock


def dial(candidates: Sequence[str], port: int, rank: int, want: int, key: bytes,
         deadline: float, streams: int = 1, cycle: bool = True,
         moot: Optional[Callable[[], bool]] = None) -> Tuple[List[socket.socket], str]:
    """`streams` settled connections to rank `want`, all at the first of `candidates`
    (addresses, in order of preference) whose far end proves it is that rank: (sockets,
    address). Each connect is capped at ATTEMPT_SECONDS, so an address that drops packets
    costs seconds, not the deadline; with `cycle`, the addresses are tried again and again
    until `deadline` (time.monotonic()) (a peer may start listening late), else once,
    each with its share of the time left. `moot()`, asked after each round, may end the
    wait by raising. Unreachable naming every address tried."""
    tried: Dict[str, BaseException] = {}
    while True:
        for i, addr in enumerate(candidates):
            socks: List[socket.socket] = []
            left = deadline - time.monotonic()
            cap = ATTEMPT_SECONDS if cycle else max(0.1, left / (len(candidates) - i))
            try:
                for s in range(streams):
                    left = max(0.1, deadline - time.monotonic())
                    socks.append(connect(addr, port, rank, want, s, key, left,
                                         connect_seconds=min(cap, left)))
                return socks, addr
            except (OSError, HelloRefused) as e:
                for sock in socks:
                    sock.close()
                tried[addr] = e
        if moot is not None:
            moot()
        if not cycle or time.monotonic() >= deadline:
            raise Unreachable(tried)
        time.sleep(0.05)


def _shut(sock: socket.socket) -> None:
    """Wake the thread reading `sock` (its recv returns), which then closes it."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


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
                    except OSError:  # (closed by close(), the client already gone, or no
                        time.sleep(0.01)  # descriptor left: not a spin)
                        continue
                    sock.setblocking(True)
                    with self._lock:
                        self._open.append(sock)
                        evicted = (self._open.pop(0) if len(self._open) > MAX_UNPROVEN
                                   else None)
                    if evicted is not None:  # (the oldest stranger makes room: its thread
                        _shut(evicted)       # wakes and drops it)
                    try:
                        threading.Thread(target=self._hello, args=(sock, peer), daemon=True,
                                         name=f"horolite-tcp-hello-{self.rank}").start()
                    except RuntimeError as e:  # (no thread left: this one is dropped, the
                        self._drop(sock, peer, f"no thread for its hello ({e})")  # loop goes on)

    def _hello(self, sock: socket.socket, peer) -> None:
        deadline = time.monotonic() + HELLO_SECONDS  # (for the whole hello, however it trickles)
        try:
            hello = _recv_exactly(sock, HELLO.size, deadline)
            magic, version, q, target, s, _ = HELLO.unpack(hello)
            if magic != MAGIC or version != VERSION:
                raise HelloRefused("not a horolite hello")
            if target != self.rank:
                raise HelloRefused(f"it wanted rank {target}")
            if q not in self.slots or not 0 <= s < len(self.slots[q]):
                raise HelloRefused(f"rank {q} stream {s} is not one this rank takes")
            head = REPLY.pack(MAGIC, VERSION, self.rank, q, s, os.urandom(16),
                              b"\0" * MAC_BYTES)[:-MAC_BYTES]
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            sock.sendall(head + _mac(self.key, b"A", hello, head))
            proof = _recv_exactly(sock, MAC_BYTES, deadline)
            if not hmac.compare_digest(proof, _mac(self.key, b"C", hello, head)):
                raise HelloRefused("it does not hold this job's key")
            with self._lock:
                if self._stop or self.slots[q][s] is not None:
                    raise HelloRefused(f"rank {q} stream {s} is already connected")
                if sock not in self._open:
                    raise HelloRefused("cut off (too many connections without a hello)")
                sock.sendall(ACK)
                self.slots[q][s] = settle(sock)
                self._open.remove(sock)
                self.missing -= 1
                if not self.missing:
                    self.complete.set()
        except (OSError, HelloRefused, struct.error) as e:
            self._drop(sock, peer, "silent" if isinstance(e, socket.timeout)
                       else str(e) or type(e).__name__)

    def _drop(self, sock: socket.socket, peer, why: str) -> None:
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
            _shut(sock)
        for sock in pending + self._listeners:
            sock.close()

    def taken(self) -> Dict[int, List[socket.socket]]:
        """The streams that arrived (call after close())."""
        return self.slots
