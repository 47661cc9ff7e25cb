"""Host lists for ``-H/--hosts`` and ``--hostfile``, validated before anything starts."""
from __future__ import annotations

import re
import socket
from typing import Iterable, List, Sequence, Tuple

__all__ = ["Host", "parse_hosts", "parse_hostfile", "total_slots", "is_local", "check_resolvable",
           "rank_hosts"]

Host = Tuple[str, int]  # (name, slots)

# Host names, IPv4 addresses, and IPv6 addresses in brackets ([::1]:2).
_NAME = re.compile(r"^(?:[A-Za-z0-9_](?:[A-Za-z0-9_.\-]*[A-Za-z0-9_])?|\[[0-9A-Fa-f:.]+\])$")


def _host(name: str, slots: str, where: str) -> Host:
    name = name.strip()
    if not _NAME.match(name):
        raise ValueError(f"bad host name {name!r} in {where}")
    try:
        n = int(slots)
    except ValueError:
        raise ValueError(f"bad slot count {slots!r} for host {name!r} in {where}: "
                         f"expected a positive integer") from None
    if n < 1:
        raise ValueError(f"bad slot count {n} for host {name!r} in {where}: must be at least 1")
    return (name.strip("[]"), n)


def _merge(hosts: Iterable[Host]) -> Tuple[Host, ...]:
    """Keep the order of first appearance; a host listed twice adds up its slots."""
    merged = {}
    for name, slots in hosts:
        merged[name] = merged.get(name, 0) + slots
    return tuple(merged.items())


def parse_hosts(spec: str) -> Tuple[Host, ...]:
    """``"h1:2,h2:2"`` -> ``(("h1", 2), ("h2", 2))``; a host without ``:N`` has 1 slot."""
    hosts: List[Host] = []
    if not spec or not spec.strip():
        raise ValueError("empty host list given to -H/--hosts (expected host1:2,host2:2)")
    for entry in spec.split(","):
        entry = entry.strip()
        if not entry:
            raise ValueError(f"empty entry in host list {spec!r} (expected host1:2,host2:2)")
        where = f"-H/--hosts entry {entry!r}"
        if entry.startswith("["):  # [ipv6]:slots
            name, sep, rest = entry.partition("]")
            name += "]"
            slots = rest[1:] if rest.startswith(":") else ("1" if not rest else rest)
            if rest and not rest.startswith(":"):
                raise ValueError(f"bad {where}: expected [address]:slots")
        elif ":" in entry:
            name, _, slots = entry.rpartition(":")
        else:
            name, slots = entry, "1"
        hosts.append(_host(name, slots, where))
    return _merge(hosts)


def parse_hostfile(text: str, path: str = "hostfile") -> Tuple[Host, ...]:
    """Lines ``host slots=N`` (Open MPI/Horovod), ``host:N`` (MPICH) or ``host``; ``#`` comments."""
    hosts: List[Host] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{path} line {number} ({raw.strip()!r})"
        fields = line.split()
        name, slots = fields[0], "1"
        if ":" in name and not name.startswith("["):
            name, _, slots = name.rpartition(":")
        for field in fields[1:]:
            key, eq, value = field.partition("=")
            if key in ("slots", "max_slots", "max-slots") and eq:
                if key == "slots":
                    slots = value
            else:
                raise ValueError(f"bad {where}: expected 'host slots=N'")
        hosts.append(_host(name, slots, where))
    if not hosts:
        raise ValueError(f"{path} lists no hosts")
    return _merge(hosts)


def total_slots(hosts: Sequence[Host]) -> int:
    return sum(slots for _, slots in hosts)


def rank_hosts(hosts: Sequence[Host], num_proc: int) -> List[str]:
    """The host of each rank when ranks fill hosts in order (both MPIs' default by-slot mapping)."""
    names: List[str] = []
    for name, slots in hosts:
        names.extend([name] * slots)
    if not names:
        names = ["localhost"]
    while len(names) < num_proc:  # oversubscribed: wraps around
        names.extend(names[: num_proc - len(names)])
    return names[:num_proc]


def _local_names() -> set:
    names = {"localhost", "127.0.0.1", "::1", "localhost.localdomain"}
    try:
        names.add(socket.gethostname())
        names.add(socket.getfqdn())
    except OSError:
        pass
    return names


def is_local(name: str) -> bool:
    return name in _local_names() or name.startswith("127.")


def check_resolvable(hosts: Sequence[Host]) -> None:
    """Raise ValueError naming the first host whose name does not resolve."""
    for name, _ in hosts:
        if is_local(name):
            continue
        try:
            socket.getaddrinfo(name, None)
        except OSError as e:
            raise ValueError(f"cannot resolve host {name!r}: {e.strerror or e}") from None
