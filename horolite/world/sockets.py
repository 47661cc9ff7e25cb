"""The job world without MPI: a rendezvous, then one TCP connection per pair of ranks.

This module stands where mpi4py's MPI module stands in an MPI-launched job
(core/mpi_library.MPI is whichever of the two init() chose): the same names, as far as horolite uses them, so the
runtime, its transports and its failure handling run unchanged on either. Ranks find
each other through the rendezvous (rendezvous.py: served by horolite-run, or by rank 0
where a scheduler started the ranks); each puts where it listens and reads the others',
and every pair connects with the hello of transport/tcp_hello.py under the job's key.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import socket
import time
from typing import Dict, List, Optional

from ..transport import tcp_address
from ..transport.tcp_hello import Acceptor, Unreachable, dial
from . import codec, kept_links
from .sockets_comm import (BAND, BOR, BYTE, COMM_NULL, COMM_TYPE_SHARED, IN_PLACE, LAND, LOR,
                           MAX, MIN, SUM, UNDEFINED, Comm, Group, Op, SocketWorldError, Win,
                           processor_name)
from .requests import ANY_SOURCE, REQUEST_NULL, Request, Status
from .sockets_mesh import Mesh

__all__ = ["open_world", "close_world", "COMM_WORLD", "Comm", "Group", "Op", "Win", "Request",
           "Status", "Exception", "ANY_SOURCE", "REQUEST_NULL", "COMM_NULL", "UNDEFINED",
           "IN_PLACE", "BYTE", "LAND", "LOR", "BOR", "BAND", "SUM", "MAX", "MIN",
           "COMM_TYPE_SHARED", "THREAD_MULTIPLE", "Query_thread", "Get_processor_name",
           "Get_library_version"]

_log = logging.getLogger("horolite.world")

Exception = SocketWorldError  # noqa: A001 (MPI.Exception's name)
THREAD_MULTIPLE = 3
ERR_NO_MEM = 34  # (an error class a caller may raise Exception with)
WORLD_CONTEXT = 1
LINGER_SECONDS = 5.0  # how long a rank serving the rendezvous keeps it after its own timeout
COMM_WORLD: Optional[Comm] = None
_server = None  # the rendezvous this process serves (rank 0 of a scheduler-started job)
_workers: Dict[int, str] = {}  # {rank: elastic worker name} of this world, and its
_generation = 0  # generation: what a connection kept for the next world is named by
_me = ""  # this process's elastic worker name ("" outside an elastic job: nothing is kept)
_kept = kept_links.KeptLinks()  # this world's connections, parked for the next one


def Query_thread() -> int:
    return THREAD_MULTIPLE


def Get_processor_name() -> str:
    return processor_name()


def Get_library_version() -> str:
    return "horolite's own connections (no MPI)"


def generation_key(key: bytes, generation: int) -> bytes:
    """The key the connections of one generation of the world say their hello with: a
    rank of an older generation (a stale peer that comes back) cannot complete it."""
    if generation == 0:
        return key
    return hmac.new(key, b"horolite world generation %d" % generation, hashlib.sha256).digest()


def world_scope(generation: int) -> str:
    """The rendezvous scope where one generation's ranks put where they listen."""
    return "world" if generation == 0 else f"world.{generation}"


class Superseded(RuntimeError):
    """A newer generation of the world was announced while this one was meeting."""


def open_world(identity, key: Optional[bytes], timeout: float, iface: str = "",
               generation: int = 0, superseded=None, worker: str = "") -> Comm:
    """Meet the other ranks and connect to each; COMM_WORLD from then on. `generation`:
    which world of an elastic job (0 the first); `superseded(client)`, if given, is asked
    while waiting for the others and says whether a newer generation made this one moot
    (raises Superseded); `worker`: this process's elastic worker name, under which its
    connections to the other workers are kept into the next generation."""
    global COMM_WORLD, _server, _workers, _generation, _me
    rank, size = identity.rank, identity.size
    _me = worker
    if size == 1:
        _kept.drop_all()
        COMM_WORLD = Comm(Mesh(0, 1, {}, lambda q: f"rank {q}"), [0], WORLD_CONTEXT)
        return COMM_WORLD
    if key is None:
        mpi = (" (or start it over MPI: srun --mpi=pmi2 with the mpich wheel)"
               if identity.source.startswith("Slurm") else "")
        raise ValueError(f"rank {rank} of {size}, started without MPI ({identity.source}), "
                         "needs the job's key to meet the others: export HOROLITE_JOB_KEY "
                         "(hex, at least 16 bytes, the same on every rank; e.g. "
                         "`export HOROLITE_JOB_KEY=$(openssl rand -hex 32)`) or "
                         f"HOROLITE_JOB_KEY_FILE before starting the ranks{mpi}; "
                         "horolite-run --gloo sets it itself")
    from .rendezvous import (RendezvousClaimed, RendezvousClient, RendezvousError,
                             RendezvousTimeout)
    machine = Get_processor_name()
    me = f"rank {rank} (host {identity.host_label or machine})"
    if identity.serve and rank == 0:
        try:
            _server = _serve(identity, key)
        except OSError as e:
            _tell_launcher(rank, f"{me} failed at init: {e}")
            raise
    try:
        mine = tcp_address.offered(iface)
        binds = sorted({a.addr for a in mine} | {"127.0.0.1"})
        listeners = _listen(binds)
    except BaseException:
        _stop_serving()  # (a retried init() binds the rendezvous port again)
        raise
    port = listeners[0].getsockname()[1]
    try:
        client = RendezvousClient(identity.rendezvous_addr, identity.rendezvous_port, key,
                                  timeout, ports=identity.candidates())
    except RendezvousError as e:
        _close_all(listeners)
        _stop_serving()
        _tell_launcher(rank, f"{me} failed at init: {e}")
        raise
    acceptor, ready = None, False
    try:
        scope = world_scope(generation)
        try:
            client.put(scope, str(rank), codec.encode({
                "host": identity.host_label or machine, "machine": machine, "port": port,
                "addresses": [list(a) for a in mine],
                "by_name": tcp_address.own_host_addresses(),
                "worker": worker, "kept": _kept.offer(), "size": size}))
        except RendezvousClaimed as e:
            e.args = (_claimed_twice(e, rank, size, identity),)
            _tell_launcher(rank, f"{me} failed at init: {e}")
            raise
        hosts = _launcher_hosts(client, size)
        try:
            found = _meet(client, scope, size, timeout, hosts, superseded)
        except RendezvousClaimed as e:
            e.args = (_claimed_twice(e, rank, size, identity),)
            _tell_launcher(rank, f"{me} failed at init: {e}")
            if _server is not None:  # (let the others hear it before the server goes)
                time.sleep(min(0.25, timeout))
            raise
        except RendezvousTimeout as e:
            _tell_launcher(rank, f"{me} failed at init: {e}")
            if _server is not None:  # the others time out a moment later: let them hear
                time.sleep(min(LINGER_SECONDS, timeout))  # whom they waited for, not that
            raise  # the server went away
        peers = [codec.decode(found[str(q)]) for q in range(size)]
        other = [q for q in range(size) if peers[q].get("size", size) != size]
        if other:  # (each rank's size comes from its own environment)
            q = other[0]
            error = ValueError(
                f"{me} was started as one of {size} ranks, but rank {q} (host "
                f"{peers[q]['host']}) as one of {peers[q]['size']}: every rank needs the same "
                f"job size ({identity.source})")
            _tell_launcher(rank, f"{me} failed at init: {error}")
            if _server is not None:  # (the others wait for ranks that will never come: let
                time.sleep(min(LINGER_SECONDS, timeout))  # them say so, not that it went)
            raise error

        def where(q: int) -> str:
            return f"rank {q} (host {peers[q]['host']})"
        key = generation_key(key, generation)
        kept = _kept.agree(worker, peers, rank)
        acceptor = Acceptor(listeners, rank, {q: 1 for q in range(rank + 1, size)
                                              if q not in kept}, key)
        deadline = time.monotonic() + timeout
        moot = None if superseded is None else (lambda: superseded(client))
        socks: Dict[int, socket.socket] = {}
        try:
            socks.update(kept_links.rebind(kept, rank, generation, key, deadline, where))
            for q in range(rank):
                if q not in socks:
                    socks[q] = _dial(rank, q, peers[q], mine, machine, key, deadline, where,
                                     moot)
            while not acceptor.wait(min(deadline, time.monotonic() + 0.25)):
                if moot is not None and moot():
                    raise Superseded(f"a newer generation replaced {scope}")
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"rank {rank}: within {timeout:g} s no connection came "
                                       "from " + ", ".join(where(q)
                                                           for q in acceptor.waiting_for()))
        except TimeoutError as e:
            _tell_launcher(rank, f"{me} failed at init: {e}")
            raise
        except BaseException:
            _close_all(socks.values())
            raise
        ready = True
    finally:
        _kept.drop_all()
        client.close()
        if acceptor is None:
            _close_all(listeners)
        else:
            acceptor.close()
            if not ready:
                _close_all(s for streams in acceptor.taken().values() for s in streams if s)
    for q, streams in acceptor.taken().items():
        socks[q] = streams[0]
    COMM_WORLD = Comm(Mesh(rank, size, socks, where), list(range(size)), WORLD_CONTEXT)
    if not worker:  # (not elastic: no later world meets there; nobody may hold it open)
        _stop_serving()
    _workers, _generation = {q: peers[q].get("worker", "") for q in range(size)}, generation
    _log.info("rank %d: connected to %d ranks without MPI (rendezvous %s:%d%s)", rank,
              size - 1, identity.rendezvous_addr, identity.rendezvous_port,
              f", generation {generation}, {len(kept)} kept from the one before"
              if generation else "")
    return COMM_WORLD


def _serve(identity, key: bytes):
    """The rendezvous rank 0 of a scheduler-started job serves: on the first of the
    identity's candidate ports it can bind; an error naming them, where they came from,
    and the fix when it can bind none."""
    from .rendezvous import RendezvousServer
    addr = identity.rendezvous_addr
    loopback = addr == "localhost" or addr.startswith("127.")
    host = "127.0.0.1" if loopback else "0.0.0.0"  # (a one-host job exposes nothing)
    failed = []
    for port in identity.candidates():
        try:
            return RendezvousServer(key, host, port)
        except OSError as e:
            failed.append(f"{port}: {os.strerror(e.errno) if e.errno else e}")
    came = identity.port_from or "its source's port"
    fix = ("choose another free port for HOROLITE_RENDEZVOUS_PORT, the same on every rank"
           if came == "HOROLITE_RENDEZVOUS_PORT" else
           "set HOROLITE_RENDEZVOUS_PORT to a free port on this host, the same on every rank")
    raise OSError(f"rank 0 cannot serve the rendezvous on {host} at port "
                  f"{'; '.join(failed)} (from {came}, {identity.source}): {fix}")


def _claimed_twice(e, rank: int, size: int, identity) -> str:
    """A rank claimed by two processes, said with both hosts."""
    def host(side) -> str:
        address, value = side
        try:
            entry = codec.decode(value)
            return f"host {entry['host']} ({address})"
        except (ValueError, KeyError, TypeError):
            return address
    what = (f"rank {e.key} of {size} was claimed by two processes: first by "
            f"{host(e.first)}, then by {host(e.second)}; the second is refused. ")
    if identity.source.startswith("torchrun"):
        return what + ("Give each node its own --node-rank (torchrun), or each pod its own "
                       "RANK; a PyTorchJob with nprocPerNode above 1 needs torchrun")
    return what + f"Each process needs its own rank (this one's came from {identity.source})"


def _stop_serving() -> None:
    global _server
    if _server is not None:
        _server.close()
        _server = None


def _meet(client, scope: str, size: int, timeout: float, hosts, superseded):
    """Every rank's entry in `scope`; asked in slices when a newer generation may come."""
    from .rendezvous import RendezvousTimeout
    keys = [str(q) for q in range(size)]

    def describe(k):
        return f"rank {k}" + hosts.get(int(k), "")
    if superseded is None:
        return client.wait_all(scope, keys, timeout, describe=describe)
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            return client.wait_all(scope, keys, max(0.0, min(0.25, left)), describe=describe,
                                   waited=timeout)
        except RendezvousTimeout:
            if superseded(client):
                raise Superseded(f"a newer generation replaced {scope}") from None
            if left <= 0.25:
                raise


def _launcher_hosts(client, size: int) -> Dict[int, str]:
    """{rank: " (host h)"} as the launcher laid the ranks out (horolite-run --gloo puts
    it at the rendezvous); empty where a scheduler started the ranks."""
    from .rendezvous import HOSTS, RendezvousTimeout
    try:
        hosts = client.get(*HOSTS, timeout=0).decode().split("\n")
    except RendezvousTimeout:
        return {}
    return {q: f" (host {h})" for q, h in enumerate(hosts[:size])}


def _tell_launcher(rank: int, text: str) -> None:
    """Set-up failed: horolite-run's summary says why (the process hooks that tell it of
    a later failure come with the runtime, after set-up)."""
    from ..failure.channel import launcher_marker
    launcher_marker("cause", rank=rank, code=1, text=text)


def _listen(binds: List[str]) -> List[socket.socket]:
    from ..transport.tcp import listen
    return listen(binds, os.environ.get("HOROLITE_TCP_PORT_RANGE", ""))


def _close_all(socks) -> None:
    for sock in list(socks):
        sock.close()


def _dial(rank: int, q: int, peer: dict, mine, machine: str, key: bytes, deadline: float,
          where, moot=None) -> socket.socket:
    """The connection to rank q (below this rank): every address it offers, in turn, each
    attempt capped (tcp_hello.dial), until the deadline."""
    theirs = [tcp_address.Address(*a) for a in peer["addresses"]]
    candidates = (["127.0.0.1"] if peer["machine"] == machine else []) + \
        tcp_address.order_for(mine, theirs, peer["by_name"])

    def superseded():
        if moot is not None and moot():
            raise Superseded(f"a newer generation replaced the one {where(q)} was in")
    try:
        return dial(candidates, peer["port"], rank, q, key, deadline, moot=superseded)[0][0]
    except Unreachable as e:
        raise TimeoutError(f"rank {rank} could not reach {where(q)} at any of "
                           f"{candidates} port {peer['port']}: {e}") from None


def check_lost() -> None:
    """Raise the LinkLost of the first connection of this world that closed, if any."""
    mesh = COMM_WORLD.mesh if COMM_WORLD is not None else None
    if mesh is not None and mesh.lost:
        raise mesh.lost[min(mesh.lost)]


def close_world(keep_server: bool = False) -> None:
    """At process exit (or between two generations of an elastic job, keeping the
    rendezvous this process serves, and the connections that may serve the next world):
    the connections, and that rendezvous."""
    global _server, COMM_WORLD
    if COMM_WORLD is not None:
        if keep_server and _me:
            _kept.park(COMM_WORLD.mesh, _workers, _generation)
        else:
            COMM_WORLD.mesh.close()
        if keep_server:
            COMM_WORLD = None
    if _server is not None and not keep_server:
        _server.close()
        _server = None
