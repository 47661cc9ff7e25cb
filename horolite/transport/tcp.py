"""horolite's own TCP connections between hosts: which transport, addresses, set-up.

Across hosts the ring's pieces travel over connections horolite opens itself
(transport/tcp_link.py moves the messages), so that waiting for the network costs
no CPU: MPI over TCP moves bytes only while a thread is inside an MPI call. Where
the hosts have an RDMA fabric (InfiniBand, RoCE) MPI stays: UCX's verbs beat any
socket. HOROLITE_CROSS_HOST_TRANSPORT=auto|tcp|mpi chooses; every rank logs the
choice and why once at init.

Set-up is collective over the runtime's communicator and never hangs: each rank
listens on the addresses it offers (tcp_address.py: HOROLITE_TCP_IFACE's, or every
address but loopback, bridges and interfaces without carrier) and on loopback, all on
one port (within HOROLITE_TCP_PORT_RANGE if set); the addresses travel over MPI (an
allgather), each rank connects to the ring neighbours above it, trying each one's
addresses in turn until one answers the hello (tcp_hello.py: two-way, authenticated
with a key that only MPI carried), and accepts those below, every step under
HOROLITE_TCP_TIMEOUT_SECONDS; then the outcomes travel too, so one rank's failure (no
address that answers, a taken port range, a missing interface) is the same clear error
on every rank, naming both hosts and every address tried. Strangers that connect
meanwhile are dropped. Ranks of one real machine (pretend hosts in tests, or the
in-host ring of the hierarchical allreduce) connect over loopback.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

from ..core.mpi_library import MPI

from ..failure.links import LinkLost
from .ring import Ring
from . import tcp_address, tcp_hello
from .tcp_control import ControlWaiter, TcpControl, partners
from .tcp_link import Peer, TcpLink

__all__ = ["choose", "TcpMesh", "open_mesh", "attach", "SetupError"]

_log = logging.getLogger("horolite.transport.tcp")

# (An established connection's settings, keepalives and buffers: tcp_hello.settle.)
# Where ranks of one machine reach each other when no interface is named.
LOOPBACK = "127.0.0.1"


class SetupError(RuntimeError):
    """horolite's connections between hosts could not be made (raised on every rank)."""


def rdma_devices() -> List[str]:
    """This host's RDMA devices (InfiniBand, RoCE), as the kernel lists them."""
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


def choose(setting: str, comm: MPI.Comm, spans_hosts: bool) -> Tuple[bool, str]:
    """(use horolite's TCP connections, why). Collective: every rank decides alike, on rank
    0's setting (ranks whose settings differ, per-host profiles, still agree)."""
    if not spans_hosts:
        return False, "every rank is on one host"
    said = comm.allgather((str(setting).strip().lower(), rdma_devices()))
    value, devices = said[0][0], [found for _, found in said]
    if value == "mpi":
        return False, "HOROLITE_CROSS_HOST_TRANSPORT=mpi"
    if value == "tcp":
        return True, "HOROLITE_CROSS_HOST_TRANSPORT=tcp"
    with_rdma = [q for q, found in enumerate(devices) if found]
    if with_rdma:
        return False, (f"an RDMA fabric is present (rank {with_rdma[0]} has "
                       f"{', '.join(devices[with_rdma[0]])} in /sys/class/infiniband): MPI's "
                       "verbs beat sockets")
    return True, "no RDMA device on any host (/sys/class/infiniband is empty): a TCP network"


def port_candidates(ports: str) -> Sequence[int]:
    """The ports HOROLITE_TCP_PORT_RANGE allows ("" any, "40000" or "40000-40100")."""
    if not ports.strip():
        return [0] * 5  # (any port; tried again if a second address has it taken)
    lo, _, hi = ports.strip().partition("-")
    try:
        first, last = int(lo), int(hi or lo)
    except ValueError:
        first, last = -1, -1
    if not 0 < first <= last < 65536:
        raise OSError(f"HOROLITE_TCP_PORT_RANGE={ports!r} is not a port or a range of ports "
                      "such as 40000-40100")
    return range(first, last + 1)


def listen(binds: Sequence[str], ports: str) -> List[socket.socket]:
    """Listening sockets on each address of `binds`, all on one port of `ports`."""
    last = None
    for port in port_candidates(ports):
        socks: List[socket.socket] = []
        try:
            for bind in binds:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((bind, port))
                sock.listen(128)
                port = sock.getsockname()[1]  # (port 0: the first address's, for the rest)
            return socks
        except OSError as e:
            last = e
            for sock in socks:
                sock.close()
    raise OSError(f"no free port in HOROLITE_TCP_PORT_RANGE={ports} on {', '.join(binds)} "
                  f"(last: {last.strerror if last else '?'})")


class TcpMesh:
    """This rank's connections: one Peer per rank it exchanges with, one condition that
    every completion notifies, and the first connection lost."""

    def __init__(self, rank: int, where):
        self.job_rank = rank
        self.where = where
        self.peers: Dict[int, Peer] = {}
        self.changed = threading.Condition()
        self.lost: Optional[LinkLost] = None
        self.on_lost = None  # called (from an I/O thread) when a connection is lost
        self.kind = "tcp"

    def _lost(self, error: LinkLost) -> None:
        if self.lost is None:
            self.lost = error
        with self.changed:
            self.changed.notify_all()
        if self.on_lost is not None:
            self.on_lost()

    def check(self) -> None:
        """Raise the lost connection's LinkLost, if one was lost (the background cycle)."""
        if self.lost is not None:
            raise self.lost

    def close(self, grace: float = 2.0) -> None:
        """Collective in spirit: every peer says goodbye, then the sockets close."""
        for peer in self.peers.values():
            peer.close(grace)
        self.peers.clear()

    def abort(self) -> None:
        """This rank's job failed: end every connection now, without a goodbye (a later
        request on one fails at once)."""
        for peer in self.peers.values():
            peer.abort()


_meshes: "weakref.WeakSet[TcpMesh]" = weakref.WeakSet()


def _forget_in_child() -> None:
    """A child forked after set-up holds none of its parent's connections: the parent's
    peers must see them close when the parent ends, whatever its children do."""
    for mesh in list(_meshes):
        for peer in mesh.peers.values():
            peer.forget()
        mesh.peers.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def open_mesh(comm: MPI.Comm, wanted: Sequence[int], hostnames: Sequence[str], where,
              iface: str = "", ports: str = "", streams: int = 1,
              timeout: float = 30.0) -> TcpMesh:
    """Connect this rank to the ranks in `wanted` (ranks of `comm`). Collective over `comm`:
    every rank calls it, each with its own `wanted` (symmetric: q in mine iff I am in q's).
    SetupError on every rank if any rank failed."""
    rank = comm.Get_rank()
    machine = MPI.Get_processor_name()
    key = comm.bcast(os.urandom(32) if rank == 0 else None)
    same_machine = not iface  # ranks of one machine meet on loopback unless told otherwise
    listeners, info, problem = [], None, None
    try:
        addrs = tcp_address.offered(iface)
        binds = [a.addr for a in addrs] + ([LOOPBACK] if same_machine else [])
        listeners = listen(binds, ports)
        info = {"machine": machine, "addrs": addrs, "port": listeners[0].getsockname()[1],
                "named": tcp_address.own_host_addresses()}
    except OSError as e:
        problem = f"{where(rank)}: cannot listen: {e.strerror or e}"
    everyone = comm.allgather((info, problem))
    problems = [p for _, p in everyone if p]
    if problems:
        for listener in listeners:
            listener.close()
        raise SetupError("horolite's TCP connections between hosts: " + "; ".join(problems))
    deadline = time.monotonic() + timeout
    streams += 1  # (and the express connection: tcp_link.EXPRESS_BYTES)
    acceptor = tcp_hello.Acceptor(listeners, rank, {q: streams for q in wanted if q < rank}, key)
    mine: Dict[int, List[socket.socket]] = {}
    problem = None
    try:
        for q in sorted(q for q in wanted if q > rank):
            mine[q] = _connect(rank, q, everyone[q][0], info, machine, same_machine, streams,
                               key, deadline, timeout, where)
        if not acceptor.wait(deadline):
            missing = acceptor.waiting_for()
            offered = ", ".join(f"{a.addr}:{info['port']}" for a in info["addrs"]) or "this host"
            raise SetupError(
                f"{where(rank)} heard nothing within {timeout:g} s "
                f"(HOROLITE_TCP_TIMEOUT_SECONDS) from {', '.join(where(q) for q in missing)}, "
                f"which should have connected to {offered}")
    except SetupError as e:
        problem = str(e)
    except OSError as e:
        problem = f"{where(rank)}: {e.strerror or e}"
    finally:
        acceptor.close()
    socks = {**acceptor.taken(), **mine}
    problems = [p for p in comm.allgather(problem) if p]
    if problems:
        for pair in socks.values():
            for sock in pair:
                if sock is not None:
                    sock.close()
        raise SetupError("horolite's TCP connections between hosts: " + "; ".join(problems))
    mesh = TcpMesh(rank, where)
    _meshes.add(mesh)
    for q, pair in socks.items():
        for sock in pair:
            tcp_hello.settle(sock)  # (done by the hello already; kept for every path)
        mesh.peers[q] = Peer(rank, q, where(q), pair, mesh.changed, mesh._lost, express=True)
        _log.debug("rank %d: connected to %s at %s, %d stream(s)", rank, where(q),
                   pair[0].getpeername()[0], streams - 1)
    if acceptor.dropped:
        _log.debug("rank %d: set-up dropped %d connection(s) that were not this job's ranks",
                   rank, acceptor.dropped)
    return mesh


def _connect(rank, q, theirs, info, machine, same_machine, streams, key, deadline, timeout,
             where) -> List[socket.socket]:
    """`streams` connections to rank q, trying its addresses in order until one answers
    the hello as q; SetupError naming every address tried."""
    if same_machine and theirs["machine"] == machine:
        candidates = [LOOPBACK]
    else:
        # (as plain tuples where the world's codec carried them: no pickle, no NamedTuple)
        their_addrs = [tcp_address.Address(*a) for a in theirs["addrs"]]
        candidates = tcp_address.order_for(info["addrs"], their_addrs, theirs["named"])
    port, tried = theirs["port"], []
    try:
        socks, addr = tcp_hello.dial(candidates, port, rank, q, key, deadline, streams,
                                     cycle=False)
        _log.info("rank %d: connected to %s at %s (%s)", rank, where(q), addr,
                  f"tried {', '.join(candidates[:candidates.index(addr) + 1])} of "
                  f"{', '.join(candidates)}" if len(candidates) > 1 else "its only address")
        return socks
    except tcp_hello.Unreachable as e:
        for addr, error in e.tried.items():
            if isinstance(error, socket.timeout):
                within = (f"{timeout:g} s (HOROLITE_TCP_TIMEOUT_SECONDS)" if len(candidates) == 1
                          else f"its share of HOROLITE_TCP_TIMEOUT_SECONDS={timeout:g}")
                why = f"no answer within {within}: a firewall dropping it, or no route?"
            else:
                why = tcp_hello.reason(error)
            tried.append(f"{addr}:{port}: {why}")
    if not candidates:
        raise SetupError(f"{where(rank)} could not connect to {where(q)}: it offers no "
                         "address (HOROLITE_TCP_IFACE)")
    if len(tried) == 1:
        raise SetupError(f"{where(rank)} could not connect to {where(q)} at {tried[0]}")
    raise SetupError(f"{where(rank)} could not connect to {where(q)} at any of its "
                     f"addresses: {'; '.join(tried)}")


def _neighbours(ranks: Sequence[int], rank: int) -> set:
    if rank not in ranks or len(ranks) < 2:
        return set()
    i = ranks.index(rank)
    return {ranks[(i + 1) % len(ranks)], ranks[(i - 1) % len(ranks)]}


def attach(transport, comm: MPI.Comm, hostnames: Sequence[str], where, cfg) -> TcpMesh:
    """Connect, and give the transport's rings (the flat one, and the hierarchical
    transport's in-host and cross-host ones) links over the connections."""
    rank, size = comm.Get_rank(), comm.Get_size()
    rings = [(1, list(range(size)), lambda link: setattr(transport, "ring", Ring(link)))]
    hier = transport.hierarchical_allreduce or transport.hierarchical_allgather
    if hier is not None:
        local = hier.local_comm.allgather(rank)
        cross = hier.cross_comm.allgather(rank)
        rings.append((2, local, lambda link: setattr(hier, "local", Ring(link))))
        rings.append((3, cross, lambda link: setattr(hier, "cross", Ring(link))))
    # The control exchange across hosts: among the hosts' leaders where ranks meet on a
    # host's board first (host_control.py), else among every rank (tcp_control.py).
    host_control = transport.host_control
    talkers = ([h[0] for h in host_control.hosts] if host_control is not None
               else list(range(size)))

    def install_control(link):
        control = TcpControl(link)
        if host_control is not None:
            host_control.tcp = control  # (installed on the leaders alone)
        else:
            transport.control_tcp = control
    rings.append((4, talkers, install_control))
    wanted = set()
    for link_id, ranks, _ in rings:
        wanted |= (_neighbours(ranks, rank) if link_id != 4 else
                   {ranks[q] for q in partners(ranks.index(rank), len(ranks))}
                   if rank in ranks else set())
    mesh = open_mesh(comm, sorted(wanted), hostnames, where, cfg.tcp_iface, cfg.tcp_port_range,
                     max(1, cfg.tcp_streams), cfg.tcp_timeout_seconds)
    links = {}
    for link_id, ranks, install in rings:
        if rank not in ranks:
            continue  # (a host's other ranks, for the leaders' control ring)
        waiter = ControlWaiter(transport) if link_id == 4 else transport.waiter
        link = TcpLink(mesh, link_id, ranks, waiter)
        install(link)
        links[link_id] = link
    if hier is not None:
        hier.driver = links[3]  # waits on requests of both its rings (one condition)
    transport.cross_host = mesh
    return mesh
