"""A world without MPI is one object: two ranks as threads of one process, each holding
its own SocketWorld (nothing of either in module globals), one generation handing its
kept connections to the next, and the runtime's `MPI` being that object."""
import os
import socket

import pytest

from horolite.core import mpi_library
from horolite.world import socket_world, sockets
from horolite.world.identity import Identity
from horolite.world.rendezvous import RendezvousServer
from test_sockets_comm import in_threads

KEY = os.urandom(32)


def open_pair(port, generation=0, before=(None, None)):
    """Ranks 0 and 1 (workers w0, w1) of `generation`, each on its own thread."""
    def rank(r):
        return socket_world.open_world(
            Identity(r, 2, r, 2, "127.0.0.1", port, "test", False, None), KEY, 20.0,
            generation=generation, worker=f"w{r}", before=before[r])
    worlds, errors = in_threads([lambda r=r: rank(r) for r in range(2)])
    assert not errors, errors
    return worlds


def sums(worlds):
    results, errors = in_threads([lambda w=w: w.COMM_WORLD.allreduce(
        w.COMM_WORLD.Get_rank() + 1) for w in worlds])
    assert not errors, errors
    return results


def test_two_worlds_in_one_process_each_hold_their_own_state():
    for name in ("COMM_WORLD", "_server", "_workers", "_generation", "_me", "_kept"):
        assert not hasattr(sockets, name), name  # (no world in module globals)
    with RendezvousServer(KEY, "127.0.0.1", 0) as server:
        worlds = open_pair(server.port)
    try:
        assert [w.COMM_WORLD.Get_rank() for w in worlds] == [0, 1]
        assert [w.worker for w in worlds] == ["w0", "w1"]
        assert all(w.workers == {0: "w0", 1: "w1"} and w.generation == 0 for w in worlds)
        assert worlds[0].COMM_WORLD.mesh is not worlds[1].COMM_WORLD.mesh
        assert sums(worlds) == [3, 3]
        worlds[1].check_lost()
    finally:
        worlds[0].close()
    with pytest.raises(Exception, match="rank 0"):  # (its peer's world closed; its own is
        worlds[1].COMM_WORLD.allreduce(1)  # the one that tells)
    with pytest.raises(Exception, match="rank 0"):
        worlds[1].check_lost()
    worlds[1].close()


def test_the_next_generation_takes_over_the_kept_connections_of_the_world_before():
    with RendezvousServer(KEY, "127.0.0.1", 0) as server:
        first = open_pair(server.port)
        links = [w.COMM_WORLD.mesh._socks[1 - r] for r, w in enumerate(first)]
        for w in first:
            w.close(keep_server=True)
        assert all(w.COMM_WORLD is None and w.kept.offer() == {f"w{1 - r}": 0}
                   for r, w in enumerate(first))
        second = open_pair(server.port, 1, first)
    try:
        assert [w.generation for w in second] == [1, 1]
        assert [w.COMM_WORLD.mesh._socks[1 - r] for r, w in enumerate(second)] == links
        assert all(w.kept.offer() == {} for w in first)  # (handed over, none left behind)
        assert sums(second) == [3, 3]
    finally:
        for w in second:
            w.close()


def test_the_runtime_holds_the_world_as_its_mpi(monkeypatch):
    world = socket_world.open_world(Identity(0, 1, 0, 1, "", 0, "test", False, None), None,
                                    5.0, generation=3)
    monkeypatch.setattr(mpi_library, "_chosen", None)
    assert not mpi_library.without_mpi()
    mpi_library.use(world)
    assert mpi_library.without_mpi()
    names = mpi_library.MPI
    assert names.COMM_WORLD is world.COMM_WORLD and names.COMM_WORLD.Get_size() == 1
    assert names.Exception is sockets.Exception and names.Op is sockets.Op
    assert names.Query_thread() == names.THREAD_MULTIPLE
    assert mpi_library.chosen().generation == 3
    with pytest.raises(AttributeError, match="COMM_SELF"):
        names.COMM_SELF  # noqa: B018 (a name the world does not have is named)
    world.close()


def test_a_world_that_did_not_form_frees_the_rendezvous_it_served(monkeypatch):
    # (rank 0 of a scheduler-started job serves; rank 1 never comes: a retried init()
    # must find the port free, not the server of the failed attempt still bound on it)
    monkeypatch.setattr(socket_world, "LINGER_SECONDS", 0.0)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    alone = Identity(0, 2, 0, 2, "127.0.0.1", port, "test", True, None)
    for _ in range(2):
        with pytest.raises(Exception, match="rank 1"):
            socket_world.open_world(alone, KEY, 0.5)
        with RendezvousServer(KEY, "127.0.0.1", port):
            pass
