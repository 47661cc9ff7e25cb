"""A small key-value store over TCP where the ranks of a job without MPI find each other.

Rank 0 (or the launcher) serves it; every rank puts its own address under its rank and
waits for the others', in a scope per generation of the world ("world.<n>"), which can
be deleted when that generation is over. Values are bytes and the framing is our own
(a 4-byte length, then fields each with a 4-byte length): nothing here is unpickled,
and no frame may claim more than MAX_FRAME, so garbage cannot make the server allocate.

Anything may connect to the port while the job starts, so each connection says its
hello in a thread of its own under a deadline (HELLO_SECONDS), and one that is silent,
speaks garbage or lacks the key is dropped (logged at debug) while the others go on.
The hello is two-way and the key never crosses the wire:

    server -> client   MAGIC, VERSION, server nonce
    client -> server   MAGIC, VERSION, client nonce, HMAC(key, CONTEXT + snonce + cnonce)
    server -> client   HMAC(key, CONTEXT + b"/server" + cnonce + snonce)

Like the ranks' own TCP hello, it proves who is at the other end; what follows is
neither encrypted nor signed. Waits happen on the server, on a condition, not by polling.
"""
from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import select
import socket
import struct
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

__all__ = ["RendezvousServer", "RendezvousClient", "RendezvousError", "RendezvousTimeout",
           "RendezvousClaimed",
           "HELLO_SECONDS", "MAX_FRAME", "HOSTS"]

_log = logging.getLogger("horolite.world.rendezvous")

MAGIC, VERSION = b"HLRV", 1
CONTEXT = b"horolite-rendezvous"
NONCE_BYTES, MAC_BYTES = 16, 32
MIN_KEY_BYTES = 16
MAX_FRAME = 16 << 20
# A client's hello arrives within milliseconds of its connect; a silent stranger holds
# only its own thread this long.
HELLO_SECONDS = 10.0
# Connections that have not yet proved the key: beyond this many, the oldest is cut off,
# so strangers hold at most this many threads and descriptors of the serving process.
MAX_UNPROVEN = 64
_ANSWER_SECONDS = 30.0  # a client's wait for an answer, beyond the wait it asked for
# A client's wait for the greeting where the server may be on one of several ports: ours
# greets at once, a squatter never.
_PROBE_SECONDS = 2.0
_LEN, _SECONDS = struct.Struct(">I"), struct.Struct(">d")
# (scope, key) where a launcher that laid the ranks out puts each rank's host, one a line
# in rank order: a rank left waiting for one that never came can say where it should be.
HOSTS = ("launcher", "hosts")
_GREETING, _ANSWER = len(MAGIC) + 1 + NONCE_BYTES, len(MAGIC) + 1 + NONCE_BYTES + MAC_BYTES

_PUT, _GET, _WAIT_ALL, _DELETE = b"P", b"G", b"W", b"D"
_OK, _VALUE, _LATE, _MISSING, _CLAIMED = b"K", b"V", b"T", b"M", b"C"


class RendezvousError(ConnectionError):
    """The rendezvous server could not be reached, refused us, or went away."""


class RendezvousTimeout(RendezvousError, TimeoutError):
    """What was waited for was not put in time; the message names every missing key."""


class RendezvousClaimed(RendezvousError):
    """Two processes claimed one key of a world's scope (a rank started twice): `key`,
    and for each claimant, first the winner, (its address, the value it put)."""

    def __init__(self, where: str, scope: str, fields: List[bytes]):
        self.key = fields[0].decode()
        self.first = (fields[1].decode(), fields[2])
        self.second = (fields[3].decode(), fields[4])
        super().__init__(f"{where}: {self.key!r} of scope {scope!r} was claimed twice, by "
                         f"{self.first[0]} and then by {self.second[0]}")


class _Claimed(Exception):
    def __init__(self, fields: List[bytes]):
        super().__init__("claimed twice")
        self.fields = fields


class _Stranger(Exception):
    """The far end does not speak this protocol, or not with this job's key."""


def _client_mac(key: bytes, snonce: bytes, cnonce: bytes) -> bytes:
    return hmac.new(key, CONTEXT + snonce + cnonce, hashlib.sha256).digest()


def _server_mac(key: bytes, snonce: bytes, cnonce: bytes) -> bytes:
    return hmac.new(key, CONTEXT + b"/server" + cnonce + snonce, hashlib.sha256).digest()


def _check_key(key: bytes) -> bytes:
    if not isinstance(key, (bytes, bytearray)) or len(key) < MIN_KEY_BYTES:
        raise ValueError(f"the rendezvous key must be at least {MIN_KEY_BYTES} bytes")
    return bytes(key)


def _recv_exactly(sock: socket.socket, n: int, deadline: Optional[float] = None) -> bytes:
    """n bytes; with a `deadline` (time.monotonic()), all by then (socket.timeout)."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("timed out")
            sock.settimeout(left)
        k = sock.recv_into(view[got:])
        if not k:
            raise EOFError(f"the connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def _frame(op: bytes, *fields: bytes) -> bytes:
    body = op + b"".join(_LEN.pack(len(f)) + f for f in fields)
    if len(body) > MAX_FRAME:
        raise ValueError(f"a rendezvous message of {len(body)} bytes is over the limit "
                         f"of {MAX_FRAME}")
    return _LEN.pack(len(body)) + body


def _read_frame(sock: socket.socket) -> bytes:
    (n,) = _LEN.unpack(_recv_exactly(sock, _LEN.size))
    if not 0 < n <= MAX_FRAME:
        raise _Stranger(f"a frame of {n} bytes (the limit is {MAX_FRAME})")
    return _recv_exactly(sock, n)


def _fields(body: bytes) -> List[bytes]:
    out, at = [], 1
    while at < len(body):
        if at + _LEN.size > len(body):
            raise _Stranger("a frame ends inside a field's length")
        (n,) = _LEN.unpack_from(body, at)
        at += _LEN.size
        if at + n > len(body):
            raise _Stranger("a field runs past the end of its frame")
        out.append(body[at:at + n])
        at += n
    return out


def _seconds(timeout: Optional[float]) -> bytes:
    return _SECONDS.pack(-1.0 if timeout is None else max(0.0, float(timeout)))


class _Closes:
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RendezvousServer(_Closes):
    """Serves the store on host:port (port 0: any free one, see `.port`) from construction
    until close()."""

    def __init__(self, key: bytes, host: str = "0.0.0.0", port: int = 0, *,
                 hello_seconds: float = HELLO_SECONDS):
        self._key, self._hello_seconds = _check_key(key), hello_seconds
        self._listener = socket.create_server((host, port))
        self._listener.settimeout(0.2)
        self.port: int = self._listener.getsockname()[1]
        self.dropped = 0  # connections dropped as strangers (for tests and diagnostics)
        self._store: Dict[str, Dict[str, bytes]] = {}
        self._cond = threading.Condition()
        self._open, self._closed = set(), False
        self._unproven: Dict[socket.socket, None] = {}  # (in arrival order: the oldest first)
        self._claims: Dict[tuple, tuple] = {}  # {(scope, key): (its putter, peer address)}
        self._conflicts: Dict[str, List[bytes]] = {}  # {scope: a _CLAIMED reply's fields}
        self._thread = threading.Thread(target=self._accept, daemon=True,
                                        name=f"horolite-rendezvous-{self.port}")
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, peer = self._listener.accept()
            except socket.timeout:
                continue  # (each 0.2 s, to see close())
            except OSError:  # (a client already gone, or no descriptor left)
                time.sleep(0.05)
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._cond:
                if self._closed:
                    sock.close()
                    break
                self._open.add(sock)
                self._unproven[sock] = None
                evicted = (next(iter(self._unproven)) if len(self._unproven) > MAX_UNPROVEN
                           else None)
                if evicted is not None:
                    del self._unproven[evicted]
            if evicted is not None:  # (the oldest stranger makes room: its thread wakes
                with contextlib.suppress(OSError):  # and drops it)
                    evicted.shutdown(socket.SHUT_RDWR)
            try:
                threading.Thread(target=self._serve, args=(sock, peer), daemon=True,
                                 name=f"horolite-rendezvous-{self.port}-conn").start()
            except RuntimeError as e:  # (no thread left: drop this one, keep accepting)
                with self._cond:
                    self._open.discard(sock)
                    self._unproven.pop(sock, None)
                    self.dropped += 1
                sock.close()
                _log.debug("rendezvous server :%d: dropped a connection from %s:%s: no "
                           "thread for it (%s)", self.port, peer[0], peer[1], e)

    def _serve(self, sock: socket.socket, peer) -> None:
        hello = True
        try:
            self._hello(sock, time.monotonic() + self._hello_seconds)
            sock.settimeout(None)
            with self._cond:
                self._unproven.pop(sock, None)
            hello = False
            while not self._closed and sock.recv(1, socket.MSG_PEEK):  # (b"": it closed)
                self._answer(sock, peer, _read_frame(sock))
        except (_Stranger, OSError, EOFError) as e:
            if not self._closed and (hello or isinstance(e, _Stranger)):
                why = "silent" if isinstance(e, socket.timeout) else str(e) or type(e).__name__
                with self._cond:
                    self.dropped += 1
                _log.debug("rendezvous server :%d: dropped a connection from %s:%s: %s",
                           self.port, peer[0], peer[1], why)
            elif not self._closed:
                _log.debug("rendezvous server :%d: the client at %s:%s went away: %s",
                           self.port, peer[0], peer[1], e)
        finally:
            with self._cond:
                self._open.discard(sock)
                self._unproven.pop(sock, None)
            sock.close()

    def _hello(self, sock: socket.socket, deadline: float) -> None:
        """The whole hello by `deadline`, however slowly its bytes trickle in."""
        snonce = os.urandom(NONCE_BYTES)
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        sock.sendall(MAGIC + bytes([VERSION]) + snonce)
        answer = _recv_exactly(sock, _ANSWER, deadline)
        if answer[:len(MAGIC)] != MAGIC or answer[len(MAGIC)] != VERSION:
            raise _Stranger("not a horolite rendezvous hello")
        cnonce = answer[len(MAGIC) + 1:len(MAGIC) + 1 + NONCE_BYTES]
        if not hmac.compare_digest(answer[-MAC_BYTES:], _client_mac(self._key, snonce, cnonce)):
            raise _Stranger("it does not hold this job's key")
        sock.sendall(_server_mac(self._key, snonce, cnonce))

    def _answer(self, sock: socket.socket, peer, body: bytes) -> None:
        try:
            self._dispatch(sock, peer, body[:1], _fields(body))
        except _Claimed as e:
            sock.sendall(_frame(_CLAIMED, *e.fields))
        except (UnicodeDecodeError, struct.error) as e:
            raise _Stranger(f"a request it cannot read ({e})") from None

    def _dispatch(self, sock: socket.socket, peer, op: bytes, fields: List[bytes]) -> None:
        if op == _PUT and len(fields) == 3:
            scope, key, value = fields[0].decode(), fields[1].decode(), fields[2]
            with self._cond:
                claimed = self._claim(sock, peer, scope, key, value)
                if claimed is None:
                    self._store.setdefault(scope, {})[key] = value
                self._cond.notify_all()
            sock.sendall(_frame(_OK) if claimed is None else _frame(_CLAIMED, *claimed))
        elif op == _GET and len(fields) == 3:
            scope, key = fields[0].decode(), fields[1].decode()
            value = None
            if self._wait(sock, scope, [key], _SECONDS.unpack(fields[2])[0]):
                with self._cond:  # (None: deleted meanwhile)
                    value = self._store.get(scope, {}).get(key)
            sock.sendall(_frame(_LATE) if value is None else _frame(_VALUE, value))
        elif op == _WAIT_ALL and len(fields) >= 2:
            scope, keys = fields[0].decode(), [k.decode() for k in fields[2:]]
            values = None
            if self._wait(sock, scope, keys, _SECONDS.unpack(fields[1])[0]):
                with self._cond:  # (None: deleted meanwhile)
                    have = self._store.get(scope, {})
                    values = [have[k] for k in keys] if all(k in have for k in keys) else None
            if values is not None:
                sock.sendall(_frame(_OK, _LEN.pack(len(values))))
                for value in values:
                    sock.sendall(_frame(_VALUE, value))
            else:
                with self._cond:
                    have = self._store.get(scope, {})
                    missing = [k.encode() for k in keys if k not in have]
                sock.sendall(_frame(_MISSING, *missing))
        elif op == _DELETE and len(fields) == 1:
            with self._cond:
                scope = fields[0].decode()
                self._store.pop(scope, None)
                self._conflicts.pop(scope, None)
                for claim in [c for c in self._claims if c[0] == scope]:
                    del self._claims[claim]
            sock.sendall(_frame(_OK))
        else:
            raise _Stranger(f"a request it cannot read (op {op!r}, {len(fields)} fields)")

    def _claim(self, sock, peer, scope: str, key: str, value: bytes) -> Optional[List[bytes]]:
        """In a world's scope the first put of a rank wins; another process's later put of
        a different value is refused, and the scope's waiters are told: (under the lock)
        a _CLAIMED reply's fields, or None."""
        if scope != "world" and not scope.startswith("world."):
            return None
        first = self._claims.get((scope, key))
        if first is None:
            self._claims[(scope, key)] = (sock, peer)
            return None
        have = self._store.get(scope, {}).get(key)
        if first[0] is sock or have == value:
            return None
        said = [key.encode(), _where(first[1]), have or b"", _where(peer), value]
        self._conflicts.setdefault(scope, said)
        return said

    def _wait(self, sock: socket.socket, scope: str, keys: Sequence[str], seconds: float) -> bool:
        """Whether every key of scope is present within `seconds` (< 0: forever). Wakes on
        each put, and each second to give up on a client that went away."""
        deadline = None if seconds < 0 else time.monotonic() + seconds
        with self._cond:
            while True:
                if scope in self._conflicts:
                    raise _Claimed(self._conflicts[scope])
                have = self._store.get(scope, {})
                if all(k in have for k in keys):
                    return True
                if self._closed:
                    raise EOFError("the server is closing")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(1.0 if left is None else min(left, 1.0))
                if _gone(sock):
                    raise EOFError("the client went away while waiting")

    def put(self, scope: str, key: str, value: bytes) -> None:
        """A value put by the serving process itself, as a client's put would."""
        with self._cond:
            self._store.setdefault(scope, {})[key] = bytes(value)
            self._cond.notify_all()

    def items(self, scope: str) -> Dict[str, bytes]:
        """A copy of what scope holds now (the serving process's own read)."""
        with self._cond:
            return dict(self._store.get(scope, {}))

    def close(self) -> None:
        """Stop serving; clients still connected see their connection close."""
        with self._cond:
            self._closed = True
            pending, self._open = list(self._open), set()
            self._cond.notify_all()
        self._thread.join()
        self._listener.close()
        for sock in pending:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # (wakes its thread out of recv)


def _where(peer) -> bytes:
    return f"{peer[0]}:{peer[1]}".encode()


def _gone(sock: socket.socket) -> bool:
    """Whether the far end closed (a waiting client sends nothing until it is answered)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and not sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (OSError, ValueError):
        return True


class RendezvousClient(_Closes):
    """A connection to the store at addr:port. The server may start after this client
    (other ranks often come before rank 0): connecting is retried for `timeout` seconds.
    Requests from several threads take turns."""

    def __init__(self, addr: str, port: int, key: bytes, timeout: float = 30.0,
                 ports: Sequence[int] = ()):
        """`ports`: every port the server may be on (rendezvous_ports.py), `port` first;
        then a server that fails the key's proof is another's, and the next is tried."""
        self.ports = tuple(ports) or (port,)
        self.addr, self.port, self._key = addr, self.ports[0], _check_key(key)
        self._timeout = timeout
        self._where = self._at(self.port)
        self._lock = threading.Lock()
        self._broken: Optional[str] = None
        self._sock = self._connect()

    def _at(self, port: int) -> str:
        return f"the rendezvous server at {self.addr}:{port}"

    def _connect(self) -> socket.socket:
        deadline = time.monotonic() + self._timeout
        pause, last = 0.05, {}
        several = len(self.ports) > 1
        while True:
            for port in self.ports:
                left = deadline - time.monotonic()
                # (one of several may be a squatter that accepts and says nothing)
                wait = max(0.1, min(left, _PROBE_SECONDS if several else HELLO_SECONDS))
                try:
                    sock = socket.create_connection((self.addr, port), timeout=wait)
                except OSError as e:
                    last[port] = e.strerror or str(e) or type(e).__name__
                    continue
                try:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    greeting = _recv_exactly(sock, _GREETING)
                except (OSError, EOFError) as e:  # (a server closing, or a silent squatter)
                    sock.close()
                    last[port] = f"no greeting ({e})"
                    continue
                self._where = self._at(port)
                try:
                    self._hello(sock, greeting)
                except (RendezvousError, OSError) as e:
                    if not several:
                        raise
                    last[port] = str(e)  # (another job's, or a stranger's: the next one)
                    continue
                sock.settimeout(None)
                self.port = port
                return sock
            left = deadline - time.monotonic()
            if left <= 0:
                if not several:
                    raise RendezvousError(f"{self._where} did not answer within "
                                          f"{self._timeout:g} s ({last[self.port]})")
                raise RendezvousError(
                    f"no rendezvous server of this job answered at {self.addr} on any of "
                    f"ports {', '.join(map(str, self.ports))} within {self._timeout:g} s ("
                    + "; ".join(f"{p}: {why}" for p, why in last.items()) + ")")
            time.sleep(min(pause, left))
            pause = min(pause * 2, 1.0)

    def _hello(self, sock: socket.socket, greeting: bytes) -> None:
        try:
            if greeting[:len(MAGIC)] != MAGIC or greeting[len(MAGIC)] != VERSION:
                raise RendezvousError(f"{self._where} is not a horolite rendezvous "
                                      f"(of this version)")
            snonce, cnonce = greeting[len(MAGIC) + 1:], os.urandom(NONCE_BYTES)
            sock.sendall(MAGIC + bytes([VERSION]) + cnonce + _client_mac(self._key, snonce, cnonce))
            try:
                proof = _recv_exactly(sock, MAC_BYTES)
            except (OSError, EOFError):
                raise RendezvousError(f"{self._where} refused our hello: it does not "
                                      f"share this job's key") from None
            if not hmac.compare_digest(proof, _server_mac(self._key, snonce, cnonce)):
                raise RendezvousError(f"{self._where} answered our hello without this "
                                      f"job's key: not this job's server")
        except BaseException:
            sock.close()
            raise

    def _request(self, frame: bytes, wait: Optional[float]) -> List[bytes]:
        """Send one request; its reply frames (the first one says how many more follow)."""
        with self._lock:
            if self._broken:
                raise RendezvousError(self._broken)
            try:
                self._sock.settimeout(None if wait is None else wait + _ANSWER_SECONDS)
                self._sock.sendall(frame)
                out = [_read_frame(self._sock)]
                if out[0][:1] == _OK and _fields(out[0]):
                    (more,) = _LEN.unpack(_fields(out[0])[0])
                    out += [_read_frame(self._sock) for _ in range(more)]
                return out
            except (OSError, EOFError, _Stranger, struct.error) as e:
                why = "it stopped answering" if isinstance(e, socket.timeout) else str(e)
                self._broken = f"{self._where} went away ({why})"
                self._sock.close()
                raise RendezvousError(self._broken) from None

    def _claimed(self, scope: str, reply: bytes) -> None:
        if reply[:1] == _CLAIMED:
            raise RendezvousClaimed(self._where, scope, _fields(reply))

    def put(self, scope: str, key: str, value: bytes) -> None:
        """RendezvousClaimed if another process put a different value under key first
        (in a world's scope)."""
        (reply,) = self._request(_frame(_PUT, scope.encode(), key.encode(), bytes(value)), 0.0)
        self._claimed(scope, reply)

    def get(self, scope: str, key: str, timeout: Optional[float] = None) -> bytes:
        """The value of key, once some client puts it (None: however long that takes)."""
        (reply,) = self._request(_frame(_GET, scope.encode(), key.encode(), _seconds(timeout)),
                                 timeout)
        self._claimed(scope, reply)
        if reply[:1] == _LATE:
            raise RendezvousTimeout(f"{self._where}: {key!r} of scope {scope!r} was not "
                                    f"put within {timeout:g} s")
        return _fields(reply)[0]

    def wait_all(self, scope: str, keys: Sequence[str], timeout: float,
                 describe: Callable[[str], str] = str,
                 waited: Optional[float] = None) -> Dict[str, bytes]:
        """Every key's value once all are put; RendezvousTimeout naming each missing one
        (as `describe(key)` says it) when `timeout` passes first (`waited`: the whole wait
        to name, when this is its last slice)."""
        keys = list(keys)
        replies = self._request(_frame(_WAIT_ALL, scope.encode(), _seconds(timeout),
                                       *(k.encode() for k in keys)), timeout)
        self._claimed(scope, replies[0])
        if replies[0][:1] == _MISSING:
            missing = [k.decode() for k in _fields(replies[0])]
            raise RendezvousTimeout(
                f"{self._where}: after {timeout if waited is None else waited:g} s, scope "
                f"{scope!r} still lacks "
                f"{len(missing)} of {len(keys)}: " + ", ".join(describe(k) for k in missing))
        return {k: _fields(r)[0] for k, r in zip(keys, replies[1:])}

    def delete_scope(self, scope: str) -> None:
        """Forget every key of scope (a world generation that is over)."""
        self._request(_frame(_DELETE, scope.encode()), 0.0)

    def close(self) -> None:
        """Close the connection; a request another thread waits on fails at once."""
        self._broken = self._broken or "this rendezvous client is closed"
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
