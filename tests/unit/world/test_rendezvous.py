"""The authenticated key-value store where ranks without MPI meet (horolite/world/rendezvous.py)."""
import os
import socket
import struct
import threading
import time

import pytest

from horolite.world import rendezvous as rv
from horolite.world import rendezvous_wire
from horolite.world.rendezvous import (RendezvousClient, RendezvousError, RendezvousServer,
                                       RendezvousTimeout)

KEY = b"k" * 16
HOST = "127.0.0.1"


@pytest.fixture
def server():
    with RendezvousServer(KEY, HOST, hello_seconds=1.0) as s:
        yield s


def client(server, key=KEY, timeout=5.0):
    return RendezvousClient(HOST, server.port, key, timeout=timeout)


def free_port():
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def raw_hello(port, key=KEY):
    """A hand-made authenticated connection, for frames no client would send."""
    sock = socket.create_connection((HOST, port), timeout=5)
    greeting = rv._recv_exactly(sock, rendezvous_wire._GREETING)
    snonce, cnonce = greeting[len(rv.MAGIC) + 1:], os.urandom(rv.NONCE_BYTES)
    sock.sendall(rv.MAGIC + bytes([rv.VERSION]) + cnonce + rv._client_mac(key, snonce, cnonce))
    assert rv._recv_exactly(sock, rv.MAC_BYTES) == rv._server_mac(key, snonce, cnonce)
    return sock


def dropped_by_server(sock):
    """Whether the server closed sock (an EOF, or a reset where our bytes went unread)."""
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def wait_until(predicate, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.02)


def test_put_and_get_across_client_threads(server):
    errors, got = [], {}

    def rank(r):
        try:
            with client(server) as c:
                c.put("world.0", str(r), f"addr-{r}".encode())
                got[r] = c.wait_all("world.0", [str(q) for q in range(6)], timeout=10)
        except Exception as e:  # (reported below)
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors
    expected = {str(q): f"addr-{q}".encode() for q in range(6)}
    assert got == {r: expected for r in range(6)}


def test_get_waits_until_a_later_put(server):
    with client(server) as reader, client(server) as writer:
        threading.Timer(0.3, writer.put, ("s", "late", b"\x00value")).start()
        started = time.monotonic()
        assert reader.get("s", "late", timeout=10) == b"\x00value"
        assert time.monotonic() - started >= 0.25


def test_get_times_out_naming_the_key(server):
    with client(server) as c:
        with pytest.raises(RendezvousTimeout, match="'never' of scope 's' was not put within 0.2 s"):
            c.get("s", "never", timeout=0.2)
        c.put("s", "then", b"1")  # (the connection still works)
        assert c.get("s", "then") == b"1"


def test_wait_all_timeout_names_every_missing_key(server):
    with client(server) as c:
        c.put("world.1", "0", b"a")
        c.put("world.1", "2", b"c")
        names = {"1": "hostB", "3": "hostD", "0": "hostA", "2": "hostC"}
        with pytest.raises(RendezvousTimeout) as e:
            c.wait_all("world.1", ["0", "1", "2", "3"], timeout=0.3,
                       describe=lambda k: f"rank {k} (host {names[k]})")
        message = str(e.value)
        assert "rank 1 (host hostB)" in message and "rank 3 (host hostD)" in message
        assert "rank 0" not in message and "rank 2" not in message and "0.3 s" in message
        assert isinstance(e.value, TimeoutError) and isinstance(e.value, ConnectionError)


def test_scopes_are_independent_and_deletable(server):
    with client(server) as c:
        c.put("world.0", "k", b"old")
        c.put("world.1", "k", b"new")
        assert c.get("world.0", "k") == b"old" and c.get("world.1", "k") == b"new"
        c.delete_scope("world.0")
        with pytest.raises(RendezvousTimeout):
            c.get("world.0", "k", timeout=0.1)
        assert c.get("world.1", "k") == b"new"


def test_a_client_started_before_the_server_connects_when_it_comes():
    port = free_port()
    out = {}

    def early():
        with RendezvousClient(HOST, port, KEY, timeout=10) as c:
            out["value"] = c.get("s", "k", timeout=10)

    t = threading.Thread(target=early)
    t.start()
    time.sleep(0.5)
    with RendezvousServer(KEY, HOST, port) as s:
        with client(s) as c:
            c.put("s", "k", b"here")
        t.join(15)
    assert out == {"value": b"here"}


def test_a_server_that_never_comes_is_named_with_the_timeout():
    port = free_port()
    started = time.monotonic()
    with pytest.raises(RendezvousError, match=f"{HOST}:{port} did not answer within 0.5 s"):
        RendezvousClient(HOST, port, KEY, timeout=0.5)
    assert time.monotonic() - started < 5


def test_a_wrong_key_is_refused_by_the_server(server):
    with pytest.raises(RendezvousError, match="refused our hello"):
        client(server, key=b"x" * 16)
    wait_until(lambda: server.dropped >= 1)
    with client(server) as c:
        c.put("s", "k", b"v")
        assert c.get("s", "k") == b"v"


def test_a_server_with_a_wrong_key_is_refused_by_the_client():
    with RendezvousServer(b"x" * 16, HOST) as wrong:
        with pytest.raises(RendezvousError, match="refused our hello"):
            client(wrong)


def test_a_server_that_cannot_prove_the_key_is_refused_by_the_client():
    """A fake server that takes any hello: the client itself must refuse its proof."""
    listener = socket.create_server((HOST, 0))
    heard = []

    def fake():
        sock, _ = listener.accept()
        sock.sendall(rv.MAGIC + bytes([rv.VERSION]) + os.urandom(rv.NONCE_BYTES))
        heard.append(rv._recv_exactly(sock, rv._ANSWER))
        sock.sendall(os.urandom(rv.MAC_BYTES))
        sock.recv(1)
        sock.close()

    t = threading.Thread(target=fake)
    t.start()
    with pytest.raises(RendezvousError, match="answered our hello without this job's key"):
        RendezvousClient(HOST, listener.getsockname()[1], KEY, timeout=5)
    t.join(5)
    listener.close()
    assert KEY not in heard[0]  # (the key never crosses the wire)


def test_strangers_are_dropped_while_clients_keep_working(server):
    with client(server) as c:
        silent = socket.create_connection((HOST, server.port))
        garbage = socket.create_connection((HOST, server.port))
        garbage.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\xff" * 100)
        c.put("s", "a", b"1")  # (neither holds the server up)
        with client(server) as other:
            assert other.get("s", "a", timeout=5) == b"1"
        wait_until(lambda: server.dropped == 2)  # the silent one after hello_seconds
        silent.settimeout(5)
        heard = silent.recv(100, socket.MSG_WAITALL)  # (short: the greeting, then EOF)
        assert heard.startswith(rv.MAGIC) and len(heard) == rendezvous_wire._GREETING
        silent.close()
        garbage.settimeout(5)
        try:
            while garbage.recv(100):
                pass
        except ConnectionResetError:
            pass  # (the server closed with the garbage unread)
        garbage.close()
        assert c.get("s", "a") == b"1"


def test_an_oversize_frame_is_refused_before_it_is_read(server):
    sock = raw_hello(server.port)
    sock.sendall(struct.pack(">I", rv.MAX_FRAME + 1) + b"P")
    assert dropped_by_server(sock)  # at once: nothing allocated for 16 MiB
    wait_until(lambda: server.dropped == 1)
    with client(server) as c:
        with pytest.raises(ValueError, match="over the limit"):
            c.put("s", "big", b"\0" * rv.MAX_FRAME)
        c.put("s", "fits", b"\0" * (1 << 20))
        assert len(c.get("s", "fits")) == 1 << 20


def test_an_authenticated_peer_with_a_malformed_request_is_dropped(server):
    sock = raw_hello(server.port)
    sock.sendall(rv._frame(rv._PUT, b"\xff\xfe", b"k", b"v"))  # (not UTF-8)
    assert dropped_by_server(sock)
    wait_until(lambda: server.dropped == 1)


def test_closing_the_server_wakes_a_waiting_client():
    s = RendezvousServer(KEY, HOST)
    c = client(s)
    threading.Timer(0.3, s.close).start()
    with pytest.raises(RendezvousError, match="went away"):
        c.get("s", "never")
    c.close()


def test_keys_must_be_long_enough():
    with pytest.raises(ValueError, match="at least 16 bytes"):
        RendezvousServer(b"short", HOST)


def test_closing_a_client_fails_a_request_another_thread_waits_on(server):
    c = client(server)
    threading.Timer(0.3, c.close).start()
    with pytest.raises(RendezvousError):
        c.get("s", "never")
    with pytest.raises(RendezvousError, match="closed|went away"):
        c.put("s", "k", b"v")
