"""Connections kept between two generations of an elastic world: ranks as threads of
this process, each with its own parked links, joined by socket pairs."""
import socket
import time

import pytest

from horolite.failure.links import LinkLost

from horolite.world import kept_links
from horolite.world.sockets import generation_key
from horolite.world.sockets_comm import Comm
from horolite.world.sockets_mesh import Mesh
from test_sockets_comm import in_threads

KEY = b"k" * 32


def first_world(names):
    n = len(names)
    pairs = {(a, b): socket.socketpair() for a in range(n) for b in range(a + 1, n)}
    return [Mesh(r, n, {q: pairs[min(r, q), max(r, q)][0 if r < q else 1]
                        for q in range(n) if q != r}, lambda q: f"rank {q}")
            for r in range(n)]


def next_world(meshes, names, order, generation=1, keys=None):
    """Park every old mesh (workers `names`), then form the world of `order` (worker
    names in new rank order) from kept links only; returns the new meshes."""
    workers = dict(enumerate(names))
    kept = {}
    for r, mesh in enumerate(meshes):
        kept[names[r]] = kept_links.KeptLinks()
        kept[names[r]].park(mesh, workers, generation - 1)
    entries = [{"worker": w, "kept": kept[w].offer()} for w in order]

    def form(rank):
        me = order[rank]
        taken = kept[me].agree(me, entries, rank)
        key = (keys or {}).get(me, generation_key(KEY, generation))
        socks = kept_links.rebind(taken, rank, generation, key,
                                  time.monotonic() + 5, lambda q: f"rank {q}")
        kept[me].drop_all()
        return Mesh(rank, len(order), socks, lambda q: f"rank {q}")
    return in_threads([lambda r=r: form(r) for r in range(len(order))])


@pytest.mark.parametrize("n", [2, 3, 4])
def test_survivors_keep_their_connections_and_nothing_old_crosses(n):
    names = [f"w{i}" for i in range(n + 1)]
    meshes = first_world(names)
    # Old messages nobody received, and one sent after the peer had already parked.
    for r, mesh in enumerate(meshes):
        for q in range(n + 1):
            if q != r:
                mesh.send(1, q, 7, b"old world %d" % r)
    meshes[-1].close()  # the last worker died
    order = list(reversed(names[:-1]))  # survivors, in a new rank order
    new, errors = next_world(meshes[:-1], names[:-1] + ["gone"], order)
    assert not errors, errors
    comms = [Comm(m, list(range(n)), 1) for m in new]

    def step(c):
        r = c.Get_rank()
        c.send(("new", order[r]), dest=(r + 1) % n, tag=7)
        return c.recv(source=(r - 1) % n, tag=7), c.allgather(order[r])
    got, errors = in_threads([lambda c=c: step(c) for c in comms])
    assert not errors, errors
    for r, (msg, gathered) in enumerate(got):
        assert msg == ("new", order[(r - 1) % n])
        assert gathered == order
    for m in new:
        m.close()


def test_messages_of_the_new_world_arrive_and_old_ones_do_not():
    names = ["a", "b", "c"]
    meshes = first_world(names)
    meshes[0].send(1, 1, 5, b"stale from a")
    meshes[2].send(1, 1, 5, b"stale from c")
    new, errors = next_world(meshes, names, ["c", "a", "b"])
    assert not errors, errors
    # c is rank 0 now, a rank 1, b rank 2.
    comms = [Comm(m, [0, 1, 2], 1) for m in new]
    comms[1].send("fresh from a", dest=2, tag=5)
    comms[0].send("fresh from c", dest=2, tag=5)
    assert comms[2].recv(source=1, tag=5) == "fresh from a"
    assert comms[2].recv(source=0, tag=5) == "fresh from c"
    assert not new[2].lost
    for m in new:
        m.close()


def test_a_peer_without_the_new_generations_key_is_refused():
    names = ["a", "b"]
    meshes = first_world(names)
    stale = generation_key(KEY, 0)
    _, errors = next_world(meshes, names, names, keys={"b": stale})
    assert {i for i, _ in errors} == {0, 1}
    assert any("the connection kept from generation 0 for rank 1 failed: it did not rebind "
               "it to generation 1" in str(e) for _, e in errors), errors


def test_a_peer_that_offers_another_generation_keeps_nothing():
    names = ["a", "b"]
    meshes = first_world(names)
    mine, theirs = kept_links.KeptLinks(), kept_links.KeptLinks()
    mine.park(meshes[0], dict(enumerate(names)), 3)
    theirs.park(meshes[1], dict(enumerate(names)), 2)
    entries = [{"worker": "a", "kept": mine.offer()}, {"worker": "b", "kept": theirs.offer()}]
    assert mine.agree("a", entries, 0) == {}
    assert theirs.agree("b", entries, 1) == {}
    mine.drop_all()
    theirs.drop_all()


def test_a_link_to_a_rank_that_died_after_parking_fails_set_up_naming_it():
    names = ["a", "b"]
    meshes = first_world(names)
    kept = kept_links.KeptLinks()
    kept.park(meshes[0], dict(enumerate(names)), 0)
    meshes[1].close()  # b never parks: it died
    taken = kept.agree("a", [{"worker": "a"}, {"worker": "b", "kept": {"a": 0}}], 0)
    assert list(taken) == [1]
    with pytest.raises(ConnectionError, match="rank 0: the connection kept from generation 0 for rank 1 failed"):
        kept_links.rebind(taken, 0, 1, generation_key(KEY, 1), time.monotonic() + 2,
                          lambda q: f"rank {q}")


def test_a_rank_that_left_fails_the_old_worlds_waits_on_it_at_once():
    meshes = first_world(["a", "b"])
    kept = kept_links.KeptLinks()
    kept.park(meshes[1], {0: "a", 1: "b"}, 0)
    comm = Comm(meshes[0], [0, 1], 1)
    with pytest.raises(LinkLost, match="rank 1 closed: it left for the next generation"):
        comm.recv(source=1, tag=3)
    with pytest.raises(LinkLost):
        comm.send("late", dest=1, tag=3)
    kept.drop_all()
    meshes[0].close()


def test_a_connection_whose_send_is_stuck_is_given_up_not_kept():
    """A send to b under way and stuck (b stopped reading): leaving the world does not
    wait on it past FENCE_SECONDS; that connection is closed, the one to c kept."""
    from horolite.world import sockets_mesh
    meshes = first_world(["a", "b", "c"])
    lock = meshes[0]._send_locks[1]
    lock.acquire()  # (what a stuck sendall holds)
    try:
        start = time.monotonic()
        parked = meshes[0].park()
        assert time.monotonic() - start < sockets_mesh.FENCE_SECONDS + 1.0
        assert list(parked) == [2]
    finally:
        lock.release()
    for sock, _ in parked.values():
        sock.close()
    for m in meshes[1:]:
        m.close()
