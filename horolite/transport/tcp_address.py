"""Which addresses a rank offers its peers across hosts, and in which order a peer tries them.

A host lists many IPv4 addresses that no other host can reach it at: an idle Docker
bridge (docker0, 172.17.0.1/16 on every host that runs containers), libvirt's and
container networks' bridges, interfaces that are down or have no carrier. Matching a
peer's addresses to this host's subnets picks exactly those (every docker0 shares
172.17.0.0/16), so, as NCCL and Gloo do, they are left out unless named, and a peer's
addresses are tried in order until one answers the hello (tcp_hello.py): the address
its host name resolves to first (what ssh, mpirun and the scheduler reached it at),
then addresses on a subnet this host is on, then the rest. A wrong guess then costs
a refused connection, not the job.

HOROLITE_TCP_IFACE (horolite-run --network-interface) names the interfaces instead,
NCCL_SOCKET_IFNAME-style: "eth0,ib" are prefixes, "=eth0" exact names, "^docker,lo"
exclusions from the default choice.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import socket
from typing import List, NamedTuple, Optional, Sequence, Tuple

__all__ = ["Address", "interfaces", "offered", "order_for", "own_host_addresses"]

# Left out unless named: loopback and the bridges that container runtimes and
# hypervisors add (NCCL's default is "^docker,lo"). A pod's or a host's own eth0,
# ens*, bond*, ib* or veth* (a container's only interface) stay.
DEFAULT_EXCLUDED = ("lo", "docker", "br-", "virbr", "cni", "flannel")

_IFF_UP, _IFF_LOOPBACK, _IFF_RUNNING = 0x1, 0x8, 0x40


class Address(NamedTuple):
    iface: str
    addr: str
    prefix: int


class Interface(NamedTuple):
    name: str
    addr: str
    prefix: int
    up: bool
    loopback: bool


class _SockaddrIn(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("port", ctypes.c_uint16),
                ("addr", ctypes.c_uint8 * 4)]


class _Ifaddrs(ctypes.Structure):
    pass


_Ifaddrs._fields_ = [("next", ctypes.POINTER(_Ifaddrs)), ("name", ctypes.c_char_p),
                     ("flags", ctypes.c_uint), ("addr", ctypes.POINTER(_SockaddrIn)),
                     ("netmask", ctypes.POINTER(_SockaddrIn)), ("ifu", ctypes.c_void_p),
                     ("data", ctypes.c_void_p)]


def interfaces() -> List[Interface]:
    """Every IPv4 address of this host (secondary ones too), in the kernel's order."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    head = ctypes.POINTER(_Ifaddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        raise OSError(ctypes.get_errno(), "getifaddrs failed")
    found = []
    try:
        node = head
        while node:
            entry = node.contents
            if entry.addr and entry.addr.contents.family == socket.AF_INET:
                addr = ".".join(map(str, entry.addr.contents.addr))
                mask = ".".join(map(str, entry.netmask.contents.addr)) if entry.netmask else "0.0.0.0"
                prefix = ipaddress.IPv4Network(f"0.0.0.0/{mask}").prefixlen
                flags = entry.flags
                found.append(Interface(
                    entry.name.decode(errors="replace"), addr, prefix,
                    bool(flags & _IFF_UP and flags & _IFF_RUNNING), bool(flags & _IFF_LOOPBACK)))
            node = entry.next
    finally:
        libc.freeifaddrs(head)
    return found


def _matches(name: str, patterns: Sequence[str], exact: bool) -> bool:
    return any(name == p if exact else name.startswith(p) for p in patterns)


def parse_spec(spec: str) -> Tuple[str, List[str], bool]:
    """("include"|"exclude"|"", patterns, exact) from an NCCL_SOCKET_IFNAME-style value."""
    spec = spec.strip()
    if not spec:
        return "", [], False
    mode = "include"
    if spec.startswith("^"):
        mode, spec = "exclude", spec[1:]
    exact = spec.startswith("=")
    if exact:
        spec = spec[1:]
    return mode, [p.strip() for p in spec.split(",") if p.strip()], exact


def offered(spec: str = "", found: Optional[Sequence[Interface]] = None) -> List[Address]:
    """The addresses this rank offers its peers, in the kernel's order. OSError naming
    the interfaces if `spec` names none that has an address."""
    found = interfaces() if found is None else list(found)
    mode, patterns, exact = parse_spec(spec)
    if mode == "include":
        chosen = [i for i in found if _matches(i.name, patterns, exact)]
        if not chosen:
            names = sorted({i.name for i in found})
            raise OSError(f"no interface matches HOROLITE_TCP_IFACE={spec!r} on this host "
                          f"(its interfaces with an IPv4 address: {', '.join(names) or 'none'})")
    else:
        excluded = patterns if mode == "exclude" else DEFAULT_EXCLUDED
        usable = [i for i in found if not i.loopback and i.up]
        chosen = [i for i in usable if not _matches(i.name, excluded, exact and mode == "exclude")]
        if not chosen:  # a host whose only network is a bridge (br0 on a hypervisor)
            chosen = usable
    return [Address(i.name, i.addr, i.prefix) for i in chosen]


def own_host_addresses() -> List[str]:
    """The IPv4 addresses this host's name resolves to here (/etc/hosts, DNS): what a
    launcher that reached it by name reached. Empty if it resolves to nothing."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        return []
    return [info[4][0] for info in infos if not info[4][0].startswith("127.")]


def order_for(mine: Sequence[Address], theirs: Sequence[Address],
              their_name: Sequence[str] = ()) -> List[str]:
    """A peer's addresses in the order to try them: those its host name resolves to
    (`their_name`, resolved on its host), then those on a subnet of this host's, then
    the rest."""
    def shared(addr: str) -> bool:
        ip = ipaddress.ip_address(addr)
        return any(ip in ipaddress.ip_network(f"{a.addr}/{a.prefix}", False) for a in mine)
    ordered: List[str] = []
    for addr in [a.addr for a in theirs if a.addr in their_name] + \
            [a.addr for a in theirs if shared(a.addr)] + [a.addr for a in theirs]:
        if addr not in ordered:
            ordered.append(addr)
    return ordered

