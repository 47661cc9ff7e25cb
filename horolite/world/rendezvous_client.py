"""A rank's connection to the rendezvous (rendezvous.py has the protocol): it finds the
server, on one of several ports where rendezvous_ports.py derived several, proves the
job's key, and asks; requests from several threads take turns."""
from __future__ import annotations

import contextlib
import hmac
import os
import socket
import struct
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

from .rendezvous_wire import (_CLAIMED, _DELETE, _GET, _GREETING, _LATE, _LEN, _MISSING, _OK,
                              _PUT, _WAIT_ALL, HELLO_SECONDS, MAC_BYTES, MAGIC, NONCE_BYTES,
                              VERSION, RendezvousClaimed, RendezvousError, RendezvousTimeout,
                              _check_key, _client_mac, _Closes, _fields, _frame, _read_frame,
                              _recv_exactly, _seconds, _server_mac, _Stranger)

__all__ = ["RendezvousClient"]

_ANSWER_SECONDS = 30.0  # a client's wait for an answer, beyond the wait it asked for
# A client's wait for the greeting where the server may be on one of several ports: ours
# greets at once, a squatter never.
_PROBE_SECONDS = 1.0
_REFUSALS = 3  # hellos refused in a row by the only port that end the search


class _Refused(RendezvousError):
    """The server closed the connection during our hello."""


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
        pause, last, refused = 0.05, {}, {}
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
                    # Another job's server, or a stranger's (the next port), or ours cut
                    # us off among a crowd of strangers: a few refusals in a row from
                    # the only port are an answer (a wrong key, most likely).
                    refused[port] = refused.get(port, 0) + 1
                    retry = isinstance(e, _Refused) or not isinstance(e, RendezvousError)
                    if not several and (refused[port] >= _REFUSALS or not retry):
                        raise
                    last[port] = str(e)
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
                raise _Refused(f"{self._where} refused our hello: it does not "
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
