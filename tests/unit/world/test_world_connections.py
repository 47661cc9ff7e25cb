"""The connections of a world without MPI once set up: they block without a timeout and
keep TCP keepalives (a quiet peer is not a lost one), a reader that fails for any reason
fails the receives waiting on it, and a dial tries every address of a peer."""
import json
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from horolite.failure.links import LinkLost
from horolite.transport import tcp_hello
from horolite.world import sockets_mesh
from horolite.world.rendezvous import RendezvousServer
from horolite.world.sockets_comm import Comm
from horolite.world.sockets_mesh import HEADER, Mesh

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
KEY = os.urandom(32)

# One rank: open_world with an identity written out, then each connection's settings.
RANK = """
import json, socket, sys
from horolite.world import socket_world
from horolite.world.identity import Identity
rank, port, key = int(sys.argv[1]), int(sys.argv[2]), bytes.fromhex(sys.argv[3])
held = socket_world.open_world(
    Identity(rank, 2, rank, 2, "127.0.0.1", port, "test", False, None), key, 20.0)
world = held.COMM_WORLD
socks = world.mesh._socks.values()
print(json.dumps([[s.gettimeout(), s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)]
                  for s in socks]))
world.Barrier()
held.close()
"""


def _close_acceptor(acceptor) -> None:
    """Stop accepting and close every connection it took (a test's sockets end with it)."""
    acceptor.close()
    for s in [s for pair in acceptor.taken().values() for s in pair if s]:
        s.close()


def test_the_connections_open_world_makes_block_without_a_timeout_and_keep_alive():
    with RendezvousServer(KEY, "127.0.0.1", 0) as server:
        procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(server.port),
                                   KEY.hex()], cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for r in range(2)]
        outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    for out, _ in outs:
        assert json.loads(out.strip().splitlines()[-1]) == [[None, 1]], out


def test_a_mesh_settles_the_sockets_it_is_given():
    # (a kept link, or any path that hands Mesh a socket still under a hello's timeout)
    a, b = socket.socketpair()
    a.settimeout(10.0)
    mesh = Mesh(0, 2, {1: a}, lambda q: f"rank {q}")
    try:
        assert a.gettimeout() is None
    finally:
        mesh.close()
        b.close()


def test_a_reader_that_raises_anything_fails_the_peers_receives(monkeypatch):
    real = sockets_mesh.read_into
    calls = []

    def failing(sock, view):  # the header arrives; then reading the payload fails
        calls.append(len(view))
        if len(calls) > 1:
            raise MemoryError("no room for the message")
        return real(sock, view)
    monkeypatch.setattr(sockets_mesh, "read_into", failing)
    a, b = socket.socketpair()
    mesh = Mesh(0, 2, {1: a}, lambda q: f"rank {q} (host h1)")
    comm = Comm(mesh, [0, 1], 1)
    try:
        later = comm.Irecv(np.zeros(4, dtype=np.uint8), source=1, tag=9)
        b.sendall(HEADER.pack(1, 5, 1 << 20))  # (no posted receive fits: buffered whole)
        begun = time.monotonic()
        with pytest.raises(LinkLost, match=r"rank 1 \(host h1\).*MemoryError"):
            later.Wait()
        assert time.monotonic() - begun < 1.0
        with pytest.raises(LinkLost, match="MemoryError"):  # (and every later one too)
            comm.Irecv(np.zeros(4, dtype=np.uint8), source=1, tag=3).Wait()
    finally:
        mesh.close()
        b.close()


def test_a_header_announcing_more_than_any_tensor_is_named_not_allocated():
    a, b = socket.socketpair()
    mesh = Mesh(0, 2, {1: a}, lambda q: f"rank {q}")
    comm = Comm(mesh, [0, 1], 1)
    try:
        b.sendall(HEADER.pack(1, 5, sockets_mesh.MAX_MESSAGE + 1))
        with pytest.raises(LinkLost, match="garbled header"):
            comm.Irecv(np.zeros(4, dtype=np.uint8), source=1, tag=5).Wait()
    finally:
        mesh.close()
        b.close()


def test_an_address_that_drops_packets_costs_one_attempt_not_the_deadline(monkeypatch):
    """The first address a peer offers drops the connect (as a firewall would); the next,
    the right one, is reached within the per-attempt cap, long before the deadline."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    acceptor = tcp_hello.Acceptor([listener], 1, {0: 1}, KEY)
    real = socket.create_connection
    dropped = []

    def drops_the_first(address, timeout=None, *args, **kwargs):
        if address[0] == "10.255.255.1":
            dropped.append(timeout)
            time.sleep(timeout)  # (what a dropped SYN costs: the whole attempt)
            raise socket.timeout("timed out")
        return real(address, timeout, *args, **kwargs)
    monkeypatch.setattr(tcp_hello.socket, "create_connection", drops_the_first)
    monkeypatch.setattr(tcp_hello, "ATTEMPT_SECONDS", 0.5)
    begun = time.monotonic()
    try:
        (sock,), addr = tcp_hello.dial(["10.255.255.1", "127.0.0.1"], listener.getsockname()[1],
                                       0, 1, KEY, begun + 30)
        took = time.monotonic() - begun
        assert addr == "127.0.0.1" and dropped == [0.5]
        assert took < 2.0, took
        assert sock.gettimeout() is None
        assert acceptor.wait(time.monotonic() + 5)
        sock.close()
    finally:
        _close_acceptor(acceptor)


def test_a_dial_that_never_reaches_names_every_address_tried():
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # (bound, not listening: refused)
        with pytest.raises(tcp_hello.Unreachable, match=r"127\.0\.0\.1: .*; 127\.0\.0\.2: "):
            tcp_hello.dial(["127.0.0.1", "127.0.0.2"], port, 0, 1, KEY, time.monotonic() + 0.5)


def test_strangers_beyond_the_cap_cut_off_the_oldest_and_a_rank_still_gets_in(monkeypatch):
    monkeypatch.setattr(tcp_hello, "MAX_UNPROVEN", 8)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    port = listener.getsockname()[1]
    acceptor = tcp_hello.Acceptor([listener], 1, {0: 1}, KEY)
    strangers = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
    try:
        deadline = time.monotonic() + 5
        while acceptor.dropped < 12 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert acceptor.dropped == 12  # (20 silent strangers, 8 kept waiting)
        sock = tcp_hello.connect("127.0.0.1", port, 0, 1, 0, KEY, 5.0)
        assert acceptor.wait(time.monotonic() + 5)
        sock.close()
    finally:
        acceptor.close()
        for s in strangers + [s for pair in acceptor.taken().values() for s in pair if s]:
            s.close()


def test_a_hello_trickled_a_byte_at_a_time_is_cut_off_at_the_whole_hellos_deadline(monkeypatch):
    monkeypatch.setattr(tcp_hello, "HELLO_SECONDS", 0.6)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    acceptor = tcp_hello.Acceptor([listener], 1, {0: 1}, KEY)
    stranger = socket.create_connection(listener.getsockname())
    stop = threading.Event()

    def trickle():
        while not stop.wait(0.1):
            try:
                stranger.send(b"x")
            except OSError:
                return
    t = threading.Thread(target=trickle)
    t.start()
    try:
        time.sleep(1.5)  # (a per-recv timeout of 0.6 s would never fire: a byte each 0.1 s)
        assert acceptor.dropped == 1
    finally:
        stop.set()
        t.join()
        stranger.close()
        acceptor.close()


def test_leaving_a_world_gives_up_a_fence_the_peer_cannot_take():
    # The peer reads nothing (a partitioned host): the connection's buffers are full, so
    # the FENCE cannot go. Leaving gives that connection up after FENCE_SECONDS.
    a, b = socket.socketpair()
    mesh = Mesh(0, 2, {1: a}, lambda q: f"rank {q}")
    a.setblocking(False)
    try:
        while True:
            a.send(b"\0" * 65536)
    except BlockingIOError:
        pass
    a.setblocking(True)
    begun = time.monotonic()
    try:
        assert mesh.park() == {}
        assert time.monotonic() - begun < sockets_mesh.FENCE_SECONDS + 1.0
        assert a.fileno() == -1  # (closed, not kept)
    finally:
        mesh.close()
        b.close()


def test_no_thread_for_a_hello_drops_that_connection_and_set_up_goes_on(thread_limit_once):
    thread_limit_once(lambda name: name.startswith("horolite-tcp-hello"))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    acceptor = tcp_hello.Acceptor([listener], 1, {0: 1}, KEY)
    try:
        first = socket.create_connection(listener.getsockname())
        deadline = time.monotonic() + 5
        while acceptor.dropped < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert acceptor.dropped == 1 and first.recv(1) == b""
        first.close()
        sock = tcp_hello.connect("127.0.0.1", listener.getsockname()[1], 0, 1, 0, KEY, 5.0)
        assert acceptor.wait(time.monotonic() + 5)
        sock.close()
    finally:
        _close_acceptor(acceptor)
