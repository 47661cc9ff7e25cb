"""The rendezvous against strangers that trickle, crowd or exhaust threads, against a
rank claimed twice, and with the server on one of several ports, some squatted
(horolite/world/rendezvous.py)."""
import os
import socket
import threading
import time

import pytest

from horolite.world import rendezvous as rv
from horolite.world import rendezvous_client
from horolite.world.rendezvous import RendezvousClaimed, RendezvousClient, RendezvousServer

KEY = os.urandom(32)
HOST = "127.0.0.1"


def wait_for(what, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not what() and time.monotonic() < deadline:
        time.sleep(0.02)
    return what()


def test_100_trickling_strangers_are_all_cut_off_at_the_whole_hellos_deadline():
    with RendezvousServer(KEY, HOST, hello_seconds=1.0) as server:
        strangers = [socket.create_connection((HOST, server.port)) for _ in range(100)]
        stop = threading.Event()

        def trickle():  # one byte each 0.3 s: a per-recv timeout of 1 s would never fire
            while not stop.wait(0.3):
                for s in strangers:
                    try:
                        s.send(b"x")
                    except OSError:
                        pass
        t = threading.Thread(target=trickle)
        t.start()
        try:
            assert wait_for(lambda: server.dropped == 100, 4.0), server.dropped
            with RendezvousClient(HOST, server.port, KEY, timeout=5) as c:
                c.put("s", "k", b"v")  # (and the store still serves)
        finally:
            stop.set()
            t.join()
            for s in strangers:
                s.close()


def test_strangers_beyond_the_cap_cut_off_the_oldest_and_a_client_still_gets_in(monkeypatch):
    monkeypatch.setattr(rv, "MAX_UNPROVEN", 8)
    with RendezvousServer(KEY, HOST) as server:
        strangers = [socket.create_connection((HOST, server.port)) for _ in range(30)]
        try:
            assert wait_for(lambda: server.dropped == 22), server.dropped
            with RendezvousClient(HOST, server.port, KEY, timeout=5) as c:
                c.put("s", "k", b"v")
                assert c.get("s", "k", 0) == b"v"
        finally:
            for s in strangers:
                s.close()


def test_no_thread_for_a_connection_drops_it_and_the_server_goes_on(thread_limit_once):
    thread_limit_once(lambda name: name.endswith("-conn"))
    with RendezvousServer(KEY, HOST) as server:
        first = socket.create_connection((HOST, server.port))
        assert wait_for(lambda: server.dropped == 1)
        assert first.recv(1) == b""  # (closed)
        first.close()
        with RendezvousClient(HOST, server.port, KEY, timeout=5) as c:
            c.put("s", "k", b"v")


def test_a_rank_claimed_twice_is_refused_and_every_waiter_is_told_at_once():
    with RendezvousServer(KEY, HOST) as server:
        a, b, c = (RendezvousClient(HOST, server.port, KEY, timeout=5) for _ in range(3))
        told = []

        def wait(client):
            try:
                client.wait_all("world", ["0", "1", "2"], 30)
            except RendezvousClaimed as e:
                told.append((time.monotonic(), e))
        a.put("world", "1", b"first")
        a.put("world", "1", b"first")  # (the same claimant again, or the same entry
        b.put("world", "1", b"first")  # from another connection: no conflict)
        c.put("world", "0", b"zero")
        waiters = [threading.Thread(target=wait, args=(x,)) for x in (a, c)]
        for t in waiters:
            t.start()
        time.sleep(0.2)
        begun = time.monotonic()
        with pytest.raises(RendezvousClaimed) as second:
            b.put("world", "1", b"second")
        for t in waiters:
            t.join(5)
        assert len(told) == 2 and all(when - begun < 1.0 for when, _ in told)
        for e in [second.value] + [e for _, e in told]:
            assert e.key == "1" and e.first[1] == b"first" and e.second[1] == b"second"
            assert e.first[0] != e.second[0] and e.first[0].startswith("127.0.0.1:")
        # Outside a world's scope the latest put wins, as before.
        a.put("elastic", "latest", b"1")
        b.put("elastic", "latest", b"2")
        assert c.get("elastic", "latest", 0) == b"2"
        for x in (a, b, c):
            x.close()


def test_a_client_moves_on_from_a_squatter_and_from_another_jobs_server():
    with socket.create_server((HOST, 0)) as squatter, \
            RendezvousServer(os.urandom(32), HOST) as other_job, \
            RendezvousServer(KEY, HOST) as ours:
        ports = [squatter.getsockname()[1], other_job.port, ours.port]
        begun = time.monotonic()
        with RendezvousClient(HOST, ports[0], KEY, timeout=10, ports=ports) as c:
            took = time.monotonic() - begun
            assert c.port == ours.port
            c.put("s", "k", b"v")
        # (the silent squatter's probe only)
        assert took < rendezvous_client._PROBE_SECONDS + 1.0, took


def test_with_several_ports_and_none_ours_every_port_is_named():
    with RendezvousServer(os.urandom(32), HOST) as other_job:
        with socket.socket() as closed:
            closed.bind((HOST, 0))
            ports = [other_job.port, closed.getsockname()[1]]
            with pytest.raises(rv.RendezvousError, match=rf"any of ports {ports[0]}, {ports[1]}"
                               rf".*{ports[0]}: .*key.*; {ports[1]}: "):
                RendezvousClient(HOST, ports[0], KEY, timeout=0.5, ports=ports)
