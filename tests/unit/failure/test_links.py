"""LinkWatch: a peer's TCP connection that closes is found before the next send."""
import os
import socket
import time

import pytest

from horolite.failure.links import LinkLost, LinkWatch, listening_addresses


class _Comm:
    """rank 0 of two; rank 1 listens at `peer`."""

    def __init__(self, peer):
        self.peer = peer

    def Get_rank(self):
        return 0

    def allgather(self, mine):
        return [[], [self.peer]]


@pytest.fixture
def connected():
    server = socket.create_server(("127.0.0.1", 0))
    peer = server.getsockname()
    client = socket.create_connection(peer)
    far, _ = server.accept()
    yield peer, client, far
    for s in (server, client, far):
        s.close()


def test_a_connection_closed_by_the_peer_raises_naming_it(connected):
    peer, client, far = connected
    watch = LinkWatch(_Comm(peer), ["node1", "node1"])
    assert watch.remote
    watch.check()  # open: nothing to say
    assert watch.unsafe() == set()
    far.close()  # the peer's process ended: its end of the connection closes
    time.sleep(0.05)
    with pytest.raises(LinkLost, match=r"the connection to rank 1 \(host node1\) closed") as e:
        watch.check()
    assert e.value.ranks == [1]
    assert watch.unsafe() == {1}
    with pytest.raises(LinkLost):  # and every later send is refused too
        watch.check()


def test_connections_to_addresses_no_peer_listens_on_are_not_watched(connected):
    peer, client, far = connected
    watch = LinkWatch(_Comm(("127.0.0.1", 1)), ["node1", "node1"])
    assert not watch.remote
    far.close()
    watch.check()


def test_this_process_listeners_bound_to_an_interface_are_published():
    server = socket.create_server(("127.0.0.1", 0))
    wildcard = socket.create_server(("0.0.0.0", 0))
    try:
        found = listening_addresses()
        assert server.getsockname() in found
        assert all(ip != "0.0.0.0" for ip, _ in found)
    finally:
        server.close()
        wildcard.close()


def test_the_table_lists_this_process_tcp_sockets_only_and_leaks_no_descriptor(connected):
    from horolite.failure.links import _own_sockets, _tcp_table
    peer, client, far = connected
    unix = socket.socketpair()  # not TCP: never listed
    try:
        before = len(os.listdir("/proc/self/fd"))
        own = _own_sockets()
        assert all(s.fileno() in own.values() for s in unix)  # seen, then left out below
        table = _tcp_table(own)
        rows = {(local, remote, state) for local, remote, state, _ in table}
        assert len(os.listdir("/proc/self/fd")) == before
        assert not {s.fileno() for s in unix} & {fd for _, _, _, fd in table}
        assert (client.getsockname(), peer, 1) in rows  # TCP_ESTABLISHED
        assert (far.getsockname(), client.getsockname(), 1) in rows
        mine = {client.getsockname(), far.getsockname(), peer}
        assert all(state in (1, 10) for local, _, state in rows if local in mine)
        listening = {local for local, _, state in rows if state == 10}
        assert peer in listening  # (sockets of earlier tests may be in any other state)
    finally:
        for s in unix:
            s.close()
