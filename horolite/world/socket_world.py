"""One world of a job without MPI, held in one object: the runtime's `MPI`.

open_world meets the other ranks (the rendezvous, then one TCP connection per pair,
dialled with transport/tcp_hello) and returns a SocketWorld: the world communicator
(MPI's COMM_WORLD), the rendezvous this process serves, every rank's elastic worker name,
the generation, and the connections parked for the next generation. init() hands it to
core/mpi_library.use, so the runtime holds the world; MPI's other names (Comm, Request,
Exception, ...) it answers from sockets.py. An elastic job opens one per generation, each
taking over the rendezvous and the parked connections of the one before. Nothing of a
world lives in module globals: a process (a test, say) can hold several.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from typing import Dict, List, Optional

from ..transport import tcp_address
from ..transport.tcp_hello import Acceptor, Unreachable, dial
from . import codec, kept_links, sockets
from .sockets import Superseded, generation_key, world_scope
from .sockets_comm import Comm
from .sockets_mesh import Mesh

__all__ = ["SocketWorld", "open_world"]

_log = logging.getLogger("horolite.world")

WORLD_CONTEXT = 1
LINGER_SECONDS = 5.0  # how long a rank serving the rendezvous keeps it after its own timeout


class SocketWorld:
    """A world's state, and MPI's names for the runtime (the rest from sockets.py)."""

    own_connections = True  # (core/mpi_library.without_mpi: not mpi4py's MPI module)

    def __init__(self, comm: Comm, server=None, workers: Optional[Dict[int, str]] = None,
                 generation: int = 0, worker: str = ""):
        self.COMM_WORLD: Optional[Comm] = comm
        self.server = server  # the rendezvous this process serves (rank 0 of a scheduler job)
        self.workers = dict(workers or {})  # {rank: elastic worker name}
        self.generation = generation  # what a connection kept for the next world is named by
        self.worker = worker  # this process's worker name ("" outside an elastic job)
        self.kept = kept_links.KeptLinks()  # this world's connections, parked for the next

    def __getattr__(self, name):
        if name in sockets.__all__:
            return getattr(sockets, name)
        raise AttributeError(f"the world without MPI has no {name!r}")

    def check_lost(self) -> None:
        """Raise the LinkLost of the first connection of this world that closed, if any."""
        mesh = self.COMM_WORLD.mesh if self.COMM_WORLD is not None else None
        if mesh is not None and mesh.lost:
            raise mesh.lost[min(mesh.lost)]

    def stop_serving(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None

    def close(self, keep_server: bool = False) -> None:
        """At process exit: the connections and the rendezvous served. Between two
        generations of an elastic job (`keep_server`): the rendezvous stays, and the
        connections to other workers are parked for the next world to take over."""
        if self.COMM_WORLD is not None:
            if keep_server and self.worker:
                self.kept.park(self.COMM_WORLD.mesh, self.workers, self.generation)
            else:
                self.COMM_WORLD.mesh.close()
            if keep_server:
                self.COMM_WORLD = None
        if not keep_server:
            self.stop_serving()


def open_world(identity, key: Optional[bytes], timeout: float, iface: str = "",
               generation: int = 0, superseded=None, worker: str = "",
               before: Optional[SocketWorld] = None) -> SocketWorld:
    """Meet the other ranks and connect to each. `generation`: which world of an elastic
    job (0 the first); `superseded(client)`, if given, is asked while waiting for the
    others and says whether a newer generation made this one moot (raises Superseded);
    `worker`: this process's elastic worker name, under which its connections to the other
    workers are kept into the next generation; `before`: the world of the generation
    before (closed with keep_server), whose rendezvous and parked connections this one
    takes over. A failure leaves `before` as it was, and closes what this call opened."""
    rank, size = identity.rank, identity.size
    parked = before.kept if before is not None else kept_links.KeptLinks()
    server = before.server if before is not None else None
    if size == 1:
        parked.drop_all()
        world = SocketWorld(Comm(Mesh(0, 1, {}, lambda q: f"rank {q}"), [0], WORLD_CONTEXT),
                            server, {0: worker}, generation, worker)
    else:
        if key is None:
            raise _no_key(identity)
        started = None
        if identity.serve and rank == 0 and server is None:
            try:
                server = started = _serve(identity, key)
            except OSError as e:
                _tell_launcher(rank, f"{_me(identity)} failed at init: {e}")
                raise
        try:
            comm, workers, kept = _connect(identity, key, timeout, iface, generation,
                                           superseded, worker, parked, server is not None)
        except BaseException:
            if started is not None:  # (a retried init() binds the rendezvous port again)
                started.close()
            raise
        finally:
            parked.drop_all()
        world = SocketWorld(comm, server, workers, generation, worker)
        _log.info("rank %d: connected to %d ranks without MPI (rendezvous %s:%d%s)", rank,
                  size - 1, identity.rendezvous_addr, identity.rendezvous_port,
                  f", generation {generation}, {kept} kept from the one before"
                  if generation else "")
    if before is not None:
        before.server = None  # (handed over to this world)
    if not worker:  # (not elastic: no later world meets there; nobody may hold it open)
        world.stop_serving()
    return world


def _me(identity) -> str:
    return f"rank {identity.rank} (host {identity.host_label or sockets.Get_processor_name()})"


def _no_key(identity) -> ValueError:
    mpi = (" (or start it over MPI: srun --mpi=pmi2 with the mpich wheel)"
           if identity.source.startswith("Slurm") else "")
    return ValueError(f"rank {identity.rank} of {identity.size}, started without MPI "
                      f"({identity.source}), needs the job's key to meet the others: export "
                      "HOROLITE_JOB_KEY (hex, at least 16 bytes, the same on every rank; e.g. "
                      "`export HOROLITE_JOB_KEY=$(openssl rand -hex 32)`) or "
                      f"HOROLITE_JOB_KEY_FILE before starting the ranks{mpi}; "
                      "horolite-run --gloo sets it itself")


def _connect(identity, key: bytes, timeout: float, iface: str, generation: int, superseded,
             worker: str, parked, serving: bool):
    """(the world communicator, {rank: worker name}, how many connections were kept):
    listen, say where at the rendezvous, read the others', then connect every pair."""
    from .rendezvous import RendezvousClient, RendezvousError
    rank, size = identity.rank, identity.size
    machine = sockets.Get_processor_name()
    me = _me(identity)
    mine = tcp_address.offered(iface)
    listeners = _listen(sorted({a.addr for a in mine} | {"127.0.0.1"}))
    try:
        client = RendezvousClient(identity.rendezvous_addr, identity.rendezvous_port, key,
                                  timeout, ports=identity.candidates())
    except RendezvousError as e:
        _close_all(listeners)
        _tell_launcher(rank, f"{me} failed at init: {e}")
        raise
    acceptor, ready = None, False
    try:
        scope = world_scope(generation)
        peers = _gather(client, identity, scope, timeout, superseded, serving, parked, {
            "host": identity.host_label or machine, "machine": machine,
            "port": listeners[0].getsockname()[1], "addresses": [list(a) for a in mine],
            "by_name": tcp_address.own_host_addresses(), "worker": worker,
            "kept": parked.offer(), "size": size})

        def where(q: int) -> str:
            return f"rank {q} (host {peers[q]['host']})"
        key = generation_key(key, generation)
        kept = parked.agree(worker, peers, rank)
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
        client.close()
        if acceptor is None:
            _close_all(listeners)
        else:
            acceptor.close()
            if not ready:
                _close_all(s for streams in acceptor.taken().values() for s in streams if s)
    for q, streams in acceptor.taken().items():
        socks[q] = streams[0]
    comm = Comm(Mesh(rank, size, socks, where), list(range(size)), WORLD_CONTEXT)
    return comm, {q: peers[q].get("worker", "") for q in range(size)}, len(kept)


def _gather(client, identity, scope: str, timeout: float, superseded, serving: bool, parked,
            entry: dict) -> List[dict]:
    """Put this rank's entry in `scope` and read every rank's; a rank claimed twice or a
    job size that differs named (and the launcher told) on every rank."""
    from .rendezvous import RendezvousClaimed, RendezvousTimeout
    rank, size = identity.rank, identity.size
    me = _me(identity)
    try:
        client.put(scope, str(rank), codec.encode(entry))
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
        if serving:  # (let the others hear it before the server goes)
            time.sleep(min(0.25, timeout))
        raise
    except RendezvousTimeout as e:
        _tell_launcher(rank, f"{me} failed at init: {e}")
        if serving:  # the others time out a moment later: let them hear
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
        if serving:  # (the others wait for ranks that will never come: let
            time.sleep(min(LINGER_SECONDS, timeout))  # them say so, not that it went)
        raise error
    return peers


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
