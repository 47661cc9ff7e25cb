"""The rendezvous's wire: the hello's MACs, the frames and their limits, the replies, and
the errors its server and clients share (rendezvous.py serves, rendezvous_client.py asks).
"""
from __future__ import annotations

import hashlib
import hmac
import socket
import struct
import time
from typing import List, Optional

from ..transport.tcp_hello import HELLO_SECONDS  # (the ranks' own hello has the same limit)

__all__ = ["MAGIC", "VERSION", "CONTEXT", "NONCE_BYTES", "MAC_BYTES", "MIN_KEY_BYTES",
           "MAX_FRAME", "HELLO_SECONDS", "HOSTS", "RendezvousError", "RendezvousTimeout",
           "RendezvousClaimed"]

MAGIC, VERSION = b"HLRV", 1
CONTEXT = b"horolite-rendezvous"
NONCE_BYTES, MAC_BYTES = 16, 32
MIN_KEY_BYTES = 16
MAX_FRAME = 16 << 20
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
