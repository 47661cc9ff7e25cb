"""A small key-value store over TCP where the ranks of a job without MPI find each other.

Rank 0 (or the launcher) serves it; every rank puts its own address under its rank and
waits for the others', in a scope per generation of the world ("world.<n>"), which can
be deleted when that generation is over. Values are bytes and the framing is our own
(a 4-byte length, then fields each with a 4-byte length): nothing here is unpickled,
and no frame may claim more than MAX_FRAME, so garbage cannot make the server allocate.

Anything may connect to the port, so each connection says its hello in a thread of
its own under a deadline for the whole hello (HELLO_SECONDS, however slowly its bytes
come), at most MAX_UNPROVEN such connections wait at once (the oldest is cut off), and
one that is silent, speaks garbage or lacks the key is dropped (logged at debug) while
the others go on. In a world's scope ("world", "world.<n>") the first put of a rank
wins: another process's claim of it is refused, and everyone waiting there is told,
naming both claimants.

The hello is two-way and the key never crosses the wire:

    server -> client   MAGIC, VERSION, server nonce
    client -> server   MAGIC, VERSION, client nonce, HMAC(key, CONTEXT + snonce + cnonce)
    server -> client   HMAC(key, CONTEXT + b"/server" + cnonce + snonce)

Like the ranks' own TCP hello, it proves who is at the other end; what follows is
neither encrypted nor signed. Waits happen on the server, on a condition, not by polling.
"""
from __future__ import annotations

import contextlib
import hmac
import logging
import os
import select
import socket
import struct
import threading
import time
from typing import Dict, List, Optional, Sequence

from .rendezvous_client import RendezvousClient
from .rendezvous_wire import (_ANSWER, _CLAIMED, _DELETE, _GET, _LATE, _LEN, _MISSING, _OK,
                              _PUT, _SECONDS, _VALUE, _WAIT_ALL, HELLO_SECONDS, HOSTS,
                              MAC_BYTES, MAGIC, MAX_FRAME, NONCE_BYTES, VERSION,
                              RendezvousClaimed, RendezvousError, RendezvousTimeout,
                              _check_key, _Claimed,
                              _client_mac, _Closes, _fields, _frame, _read_frame,
                              _recv_exactly, _server_mac, _Stranger)

__all__ = ["RendezvousServer", "RendezvousClient", "RendezvousError", "RendezvousTimeout",
           "RendezvousClaimed", "HELLO_SECONDS", "MAX_FRAME", "HOSTS"]

_log = logging.getLogger("horolite.world.rendezvous")

# Connections that have not yet proved the key: beyond this many, the oldest is cut off,
# so strangers hold at most this many threads and descriptors of the serving process.
MAX_UNPROVEN = 64


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
