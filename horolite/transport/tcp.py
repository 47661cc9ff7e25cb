"""horolite's own TCP connections between hosts: which transport, addresses, set-up.

Across hosts the ring's pieces travel over connections horolite opens itself
(transport/tcp_link.py moves the messages), so that waiting for the network costs
no CPU: MPI over TCP moves bytes only while a thread is inside an MPI call. Where
the hosts have an RDMA fabric (InfiniBand, RoCE) MPI stays: UCX's verbs beat any
socket. HOROLITE_CROSS_HOST_TRANSPORT=auto|tcp|mpi chooses; every rank logs the
choice and why once at init.

Set-up is collective over the runtime's communicator and never hangs: each rank
listens (on HOROLITE_TCP_IFACE's address if set, on every address otherwise, within
HOROLITE_TCP_PORT_RANGE if set), the addresses travel over MPI (an allgather), each
rank connects to the ring neighbours above it and accepts those below, every step
under HOROLITE_TCP_TIMEOUT_SECONDS; then the outcomes travel too, so one rank's
failure (an unreachable address, a taken port range, a missing interface, a dropped
connection) is the same clear error on every rank, naming both hosts and the address
tried. Ranks of one real machine (pretend hosts in tests, or the in-host ring of
the hierarchical allreduce) connect over loopback.
"""
from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

from mpi4py import MPI

from ..failure.links import LinkLost
from .ring import Ring
from .tcp_control import RING_MAX, ControlWaiter, TcpControl
from .tcp_link import Peer, TcpLink

__all__ = ["choose", "TcpMesh", "open_mesh", "attach", "interface_address", "SetupError"]

_log = logging.getLogger("horolite.transport.tcp")

_MAGIC = 0x686C7463  # "hltc": a connection's first word, then (rank, stream, job token)
_HELLO = struct.Struct("<IiiQ")
# Socket buffers asked for: one 1 MiB piece in flight several times over (Gloo asks up
# to 32 MiB). Asked only where the kernel's maximum allows it: an explicit size below
# that maximum would turn the kernel's own tuning (up to tcp_rmem's top) off.
BUFFER_BYTES = 8 << 20
_SIOCGIFADDR, _SIOCGIFNETMASK = 0x8915, 0x891B
# A connection silent this long (keepalives unanswered, or data unacknowledged) is ended:
# longer than a link outage a job survives (the multi-host tests take links down for 20
# and 75 s; inside a collective the stall inspector speaks first, naming the silent ranks).
HALF_OPEN_SECONDS = 180
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
    """(use horolite's TCP connections, why). Collective: every rank decides alike."""
    value = str(setting).strip().lower()
    if not spans_hosts:
        return False, "every rank is on one host"
    if value == "mpi":
        return False, "HOROLITE_CROSS_HOST_TRANSPORT=mpi"
    if value == "tcp":
        return True, "HOROLITE_CROSS_HOST_TRANSPORT=tcp"
    devices = comm.allgather(rdma_devices())
    with_rdma = [q for q, found in enumerate(devices) if found]
    if with_rdma:
        return False, (f"an RDMA fabric is present (rank {with_rdma[0]} has "
                       f"{', '.join(devices[with_rdma[0]])} in /sys/class/infiniband): MPI's "
                       "verbs beat sockets")
    return True, "no RDMA device on any host (/sys/class/infiniband is empty): a TCP network"


def interface_address(name: str) -> Tuple[str, int]:
    """(IPv4 address, prefix length) of interface `name`; OSError if it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        packed = struct.pack("256s", name.encode()[:15])
        addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, packed)[20:24])
        mask = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFNETMASK, packed)[20:24])
    return addr, ipaddress.IPv4Network(f"0.0.0.0/{mask}").prefixlen


def _addresses(iface: str) -> List[Tuple[str, str, int]]:
    """(interface, address, prefix) this rank can be reached at."""
    if iface:
        return [(iface,) + interface_address(iface)]
    found = []
    for _, name in socket.if_nameindex():
        try:
            addr, prefix = interface_address(name)
        except OSError:
            continue
        if not addr.startswith("127."):
            found.append((name, addr, prefix))
    return found


def _pick(mine: Sequence[Tuple[str, str, int]], theirs: Sequence[Tuple[str, str, int]]) -> str:
    """The peer's address on a network this rank is on (else its first)."""
    for _, addr, prefix in theirs:
        for _, own, own_prefix in mine:
            if ipaddress.ip_address(addr) in ipaddress.ip_network(f"{own}/{own_prefix}", False):
                return addr
    return theirs[0][1]


def _listen(bind: str, ports: str) -> socket.socket:
    """A listening socket on `bind`, on a port of `ports` ("" any, "40000-40100")."""
    if ports:
        lo, _, hi = ports.partition("-")
        candidates = range(int(lo), int(hi or lo) + 1)
    else:
        candidates = [0]
    last = None
    for port in candidates:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((bind, port))
            sock.listen(128)
            return sock
        except OSError as e:
            last = e
            sock.close()
    raise OSError(f"no free port in HOROLITE_TCP_PORT_RANGE={ports} on {bind or '0.0.0.0'} "
                  f"(last: {last.strerror if last else '?'})")


def _tune(sock: socket.socket) -> None:
    """No Nagle; keepalives (and a limit on unacknowledged data) end a connection whose far
    host vanished without a FIN after HALF_OPEN_SECONDS; large buffers where the kernel
    allows them."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 15), ("TCP_KEEPCNT", 8),
                       ("TCP_USER_TIMEOUT", 1000 * HALF_OPEN_SECONDS)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)
    for opt, limit in ((socket.SO_SNDBUF, "wmem_max"), (socket.SO_RCVBUF, "rmem_max")):
        try:
            with open(f"/proc/sys/net/core/{limit}") as f:
                allowed = int(f.read())
        except (OSError, ValueError):
            continue
        if allowed >= BUFFER_BYTES:
            sock.setsockopt(socket.SOL_SOCKET, opt, BUFFER_BYTES)


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


def open_mesh(comm: MPI.Comm, wanted: Sequence[int], hostnames: Sequence[str], where,
              iface: str = "", ports: str = "", streams: int = 1,
              timeout: float = 30.0) -> TcpMesh:
    """Connect this rank to the ranks in `wanted` (ranks of `comm`). Collective over `comm`:
    every rank calls it, each with its own `wanted` (symmetric: q in mine iff I am in q's).
    SetupError on every rank if any rank failed."""
    rank = comm.Get_rank()
    iface = iface.split(",")[0].strip()  # (a list, as horolite-run's --network-interface takes)
    machine = MPI.Get_processor_name()
    listener, info, problem = None, None, None
    try:
        addrs = _addresses(iface)
        bind = addrs[0][1] if iface else ""
        listener = _listen(bind, ports)
        info = {"machine": machine, "addrs": addrs, "port": listener.getsockname()[1]}
    except OSError as e:
        what = f"network interface {iface!r}" if iface and "PORT_RANGE" not in str(e) else ""
        problem = (f"{where(rank)}: cannot listen"
                   + (f" on {what} (HOROLITE_TCP_IFACE; its interfaces: "
                      f"{', '.join(n for _, n in socket.if_nameindex())})" if what else "")
                   + f": {e.strerror or e}")
    everyone = comm.allgather((info, problem))
    problems = [p for _, p in everyone if p]
    if problems:
        if listener is not None:
            listener.close()
        raise SetupError("horolite's TCP connections between hosts: " + "; ".join(problems))
    token = comm.bcast(int.from_bytes(os.urandom(8), "little") if rank == 0 else None)
    mesh = TcpMesh(rank, where)
    socks: Dict[int, List[Optional[socket.socket]]] = {q: [None] * streams for q in wanted}
    deadline = time.monotonic() + timeout
    problem = None
    try:
        for q in sorted(q for q in wanted if q > rank):
            peer_info = everyone[q][0]
            addr = (LOOPBACK if not iface and (peer_info["machine"] == machine
                                               or not peer_info["addrs"])
                    else _pick(info["addrs"], peer_info["addrs"]))
            for s in range(streams):
                try:
                    sock = socket.create_connection(
                        (addr, peer_info["port"]), timeout=max(0.1, deadline - time.monotonic()))
                    sock.sendall(_HELLO.pack(_MAGIC, rank, s, token))
                except OSError as e:
                    why = (f"no answer within {timeout:g} s (HOROLITE_TCP_TIMEOUT_SECONDS): a "
                           "firewall dropping it, or no route?" if isinstance(e, socket.timeout)
                           else e.strerror or str(e))
                    raise SetupError(f"{where(rank)} could not connect to {where(q)} at "
                                     f"{addr}:{peer_info['port']}: {why}") from None
                socks[q][s] = sock
        expected = sum(streams for q in wanted if q < rank)
        while expected:
            listener.settimeout(max(0.05, deadline - time.monotonic()))
            try:
                sock, _ = listener.accept()
                sock.settimeout(max(0.05, deadline - time.monotonic()))
                hello = _recv_hello(sock)
            except socket.timeout:
                missing = sorted(q for q in wanted if q < rank and None in socks[q])
                raise SetupError(
                    f"{where(rank)} heard nothing within {timeout:g} s "
                    f"(HOROLITE_TCP_TIMEOUT_SECONDS) from "
                    f"{', '.join(where(q) for q in missing)}, which should have connected to "
                    f"{info['addrs'][0][1] if info['addrs'] else 'this host'}:{info['port']}"
                    ) from None
            magic, q, s, their_token = hello
            if magic != _MAGIC or their_token != token or q not in socks or s >= streams:
                sock.close()  # not one of this job's ranks
                continue
            socks[q][s] = sock
            expected -= 1
    except SetupError as e:
        problem = str(e)
    except OSError as e:
        problem = f"{where(rank)}: {e.strerror or e}"
    finally:
        listener.close()
    problems = [p for p in comm.allgather(problem) if p]
    if problems:
        for pair in socks.values():
            for sock in pair:
                if sock is not None:
                    sock.close()
        raise SetupError("horolite's TCP connections between hosts: " + "; ".join(problems))
    for q, pair in socks.items():
        for sock in pair:
            sock.settimeout(None)
            _tune(sock)
        mesh.peers[q] = Peer(rank, q, where(q), pair, mesh.changed, mesh._lost)
    _log.debug("rank %d: TCP connections to %s, %d stream(s) each, listening on port %d",
               rank, ", ".join(where(q) for q in sorted(mesh.peers)) or "nobody", streams,
               info["port"])
    return mesh


def _recv_hello(sock: socket.socket):
    data = b""
    while len(data) < _HELLO.size:
        chunk = sock.recv(_HELLO.size - len(data))
        if not chunk:
            return (0, -1, 0, 0)
        data += chunk
    return _HELLO.unpack(data)


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
    if len(talkers) <= RING_MAX:
        def install_control(link):
            control = TcpControl(link)
            if host_control is not None:
                host_control.tcp = control  # (installed on the leaders alone)
            else:
                transport.control_tcp = control
        rings.append((4, talkers, install_control))
    wanted = set()
    for _, ranks, _ in rings:
        wanted |= _neighbours(ranks, rank)
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
