"""The byte-level halves of a message on horolite's TCP connections (tcp_link.py's I/O
threads): a header and its buffer sent without a copy, a view filled from the socket, and
the one check a buffer must pass first, made on the caller's thread."""
from __future__ import annotations

import socket

__all__ = ["check_contiguous", "send_all", "recv_exactly"]


def check_contiguous(buf) -> None:
    """On the caller's thread: an I/O thread cannot send or fill a strided view."""
    if not memoryview(buf).c_contiguous:
        raise ValueError("horolite's TCP connections send and receive contiguous buffers "
                         "only (got a strided view)")


def send_all(sock: socket.socket, header: bytes, buf) -> None:
    """One message: its header and its bytes, in as few sendmsg calls as the kernel takes."""
    views = [memoryview(header)]
    body = memoryview(buf).cast("B")
    if body.nbytes:
        views.append(body)
    while views:
        sent = sock.sendmsg(views)
        while sent:
            if sent >= views[0].nbytes:
                sent -= views[0].nbytes
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


def recv_exactly(sock: socket.socket, view: memoryview) -> bool:
    """Fill `view`; False if the connection ended before its first byte (an orderly end)."""
    got, total = 0, view.nbytes
    while got < total:
        n = sock.recv_into(view[got:], total - got, socket.MSG_WAITALL)  # (one wake-up a piece)
        if n == 0:
            if got == 0:
                return False
            raise ConnectionResetError("the connection closed inside a message")
        got += n
    return True
