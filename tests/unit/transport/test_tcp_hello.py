"""The hello of horolite's TCP connections (tcp_hello.py) against strangers, on loopback; no
MPI. Each refusal here is one that set-up must make and survive: if the acceptor stopped
checking the key, the rank, the stream or duplicates, one of these fails."""
import os
import socket
import struct
import threading
import time

import pytest

from horolite.transport import tcp_hello
from horolite.transport.tcp_hello import Acceptor, HelloRefused, connect

KEY = os.urandom(32)


@pytest.fixture
def listener():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield sock
    sock.close()


def port(listener):
    return listener.getsockname()[1]


def test_ranks_of_one_job_connect_and_learn_whom_they_reached(listener):
    acceptor = Acceptor([listener], rank=2, expected={0: 2, 1: 1}, key=KEY)
    socks = [connect("127.0.0.1", port(listener), 0, 2, s, KEY, 5.0) for s in range(2)]
    socks.append(connect("127.0.0.1", port(listener), 1, 2, 0, KEY, 5.0))
    assert acceptor.wait(time.monotonic() + 5)
    acceptor.close()
    taken = acceptor.taken()
    assert all(sock is not None for pair in taken.values() for sock in pair)
    # Stream by stream, the accepted ends are the connectors' far ends.
    for (q, s), sock in zip([(0, 0), (0, 1), (1, 0)], socks):
        assert taken[q][s].getpeername() == sock.getsockname()
    for sock in socks + [s for pair in taken.values() for s in pair]:
        sock.close()


def stranger_silent(p):
    sock = socket.create_connection(("127.0.0.1", p))
    return sock  # says nothing, stays connected


def stranger_reset(p):
    sock = socket.create_connection(("127.0.0.1", p))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()  # an RST, as some health checks and scanners end
    return None


def stranger_garbage(p):
    sock = socket.create_connection(("127.0.0.1", p))
    sock.sendall(b"GET / HTTP/1.0\r\n\r\n" * 4)
    return sock


@pytest.mark.parametrize("stranger", [stranger_silent, stranger_reset, stranger_garbage])
def test_a_stranger_first_neither_fails_nor_delays_set_up(listener, stranger, monkeypatch):
    monkeypatch.setattr(tcp_hello, "HELLO_SECONDS", 30.0)  # a silent stranger could hold 30 s
    acceptor = Acceptor([listener], rank=1, expected={0: 1}, key=KEY)
    held = stranger(port(listener))
    time.sleep(0.1)  # the stranger is accepted first
    started = time.monotonic()
    mine = connect("127.0.0.1", port(listener), 0, 1, 0, KEY, 5.0)
    assert acceptor.wait(time.monotonic() + 5)
    assert time.monotonic() - started < 5  # not behind the stranger's 30 s
    acceptor.close()
    assert acceptor.taken()[0][0].getpeername() == mine.getsockname()
    if stranger is not stranger_silent:
        assert acceptor.dropped == 1
    for sock in (held, mine, acceptor.taken()[0][0]):
        if sock is not None:
            sock.close()


def test_another_jobs_rank_is_refused_both_ways(listener):
    """A wrong key: the acceptor's answer does not verify, so the connector refuses it;
    and the acceptor never counts the stream."""
    acceptor = Acceptor([listener], rank=1, expected={0: 1}, key=KEY)
    with pytest.raises(HelloRefused, match="another job"):
        connect("127.0.0.1", port(listener), 0, 1, 0, os.urandom(32), 5.0)
    assert not acceptor.wait(time.monotonic() + 0.3)
    acceptor.close()


def test_a_connector_without_the_key_is_refused(listener):
    """A stranger that copies a hello and answers the reply with a wrong proof."""
    acceptor = Acceptor([listener], rank=1, expected={0: 1}, key=KEY)
    sock = socket.create_connection(("127.0.0.1", port(listener)))
    sock.sendall(tcp_hello.HELLO.pack(tcp_hello.MAGIC, tcp_hello.VERSION, 0, 1, 0, os.urandom(16)))
    sock.recv(tcp_hello.REPLY.size)
    sock.sendall(b"\0" * tcp_hello.MAC_BYTES)
    assert sock.recv(1) == b""  # closed, no ACK
    assert not acceptor.wait(time.monotonic() + 0.3)
    acceptor.close()
    assert acceptor.dropped == 1
    sock.close()


@pytest.mark.parametrize("rank,want,stream,why", [
    (2, 1, 0, "not one this rank takes"),  # a rank above the acceptor (it dials those itself)
    (0, 1, 5, "not one this rank takes"),  # a stream out of range
    (0, 3, 0, "wanted rank 3"),  # dialled the wrong rank
])
def test_hellos_this_rank_does_not_take_are_refused(listener, rank, want, stream, why, caplog):
    acceptor = Acceptor([listener], rank=1, expected={0: 1}, key=KEY)
    with caplog.at_level("DEBUG", logger="horolite.transport.tcp"):
        with pytest.raises(HelloRefused):
            connect("127.0.0.1", port(listener), rank, want, stream, KEY, 5.0)
        deadline = time.monotonic() + 5
        while not acceptor.dropped and time.monotonic() < deadline:
            time.sleep(0.01)
    acceptor.close()
    assert acceptor.dropped == 1
    assert why in caplog.text


def test_a_second_hello_for_a_stream_is_refused(listener):
    acceptor = Acceptor([listener], rank=1, expected={0: 2}, key=KEY)
    first = connect("127.0.0.1", port(listener), 0, 1, 0, KEY, 5.0)
    with pytest.raises(HelloRefused, match="refused the stream"):
        connect("127.0.0.1", port(listener), 0, 1, 0, KEY, 5.0)
    second = connect("127.0.0.1", port(listener), 0, 1, 1, KEY, 5.0)
    assert acceptor.wait(time.monotonic() + 5)
    acceptor.close()
    taken = acceptor.taken()[0]
    assert [s.getpeername() for s in taken] == [first.getsockname(), second.getsockname()]
    for sock in [first, second] + taken:
        sock.close()


def test_a_silent_listener_is_given_up_within_the_hello_limit(listener, monkeypatch):
    """Dialling an address where something else listens and says nothing (another
    service on that port): the connector moves on after HELLO_SECONDS."""
    monkeypatch.setattr(tcp_hello, "HELLO_SECONDS", 0.5)
    started = time.monotonic()
    with pytest.raises(HelloRefused, match="no hello answered"):
        connect("127.0.0.1", port(listener), 0, 1, 0, KEY, 30.0)
    assert time.monotonic() - started < 10


def test_strangers_hold_no_thread_after_close(listener):
    acceptor = Acceptor([listener], rank=1, expected={0: 1}, key=KEY)
    held = [stranger_silent(port(listener)) for _ in range(3)]
    time.sleep(0.2)
    acceptor.close()
    deadline = time.monotonic() + 5
    while (any(t.name.startswith("horolite-tcp-hello") for t in threading.enumerate())
           and time.monotonic() < deadline):
        time.sleep(0.02)
    assert not any(t.name.startswith("horolite-tcp-hello") for t in threading.enumerate())
    for sock in held:
        sock.close()
