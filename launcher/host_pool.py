"""The hosts an elastic job may use: a fixed pool or a discovery script, minus the blacklist.

Horovod 0.28.1's rules: a discovery script prints ``host:slots`` (or ``host``, which
gets ``--slots-per-host``) per line; it is run about once a second, a failure of its
first run stops the launch, later failures keep the last answer. A host where a rank
failed is blacklisted; with ``--blacklist-cooldown-range MIN MAX`` it comes back after
``MIN * 2**n + uniform(0, MIN)`` seconds (n: its n-th blacklisting), kept within
[MIN, MAX]; without it, for good. Hosts keep their order of first appearance, so the
oldest hosts get the lowest ranks.
"""
from __future__ import annotations

import dataclasses
import random
import subprocess
import time
from typing import Dict, List, Optional, Sequence, Tuple

from . import hosts as hostlib

__all__ = ["Discovery", "FixedHosts", "DiscoveryScript", "HostPool", "assign"]

SCRIPT_TIMEOUT = 30.0  # seconds one run of the discovery script may take
COOLDOWN_LIMITS = (1, 3600)  # Horovod's bounds for --blacklist-cooldown-range


class Discovery:
    def find(self) -> Dict[str, int]:
        """host -> slots available now."""
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


class FixedHosts(Discovery):
    def __init__(self, hosts: Sequence[hostlib.Host], origin: str):
        self.hosts = dict(hosts)
        self.origin = origin

    def find(self) -> Dict[str, int]:
        return dict(self.hosts)

    def describe(self) -> str:
        return self.origin


class DiscoveryScript(Discovery):
    def __init__(self, script: str, default_slots: Optional[int]):
        self.script = script
        self.default_slots = default_slots

    def find(self) -> Dict[str, int]:
        try:
            proc = subprocess.run(self.script, shell=True, capture_output=True, text=True,
                                  timeout=SCRIPT_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"--host-discovery-script {self.script!r} did not finish within "
                               f"{SCRIPT_TIMEOUT:g} s") from None
        if proc.returncode != 0:
            raise RuntimeError(f"--host-discovery-script {self.script!r} exited with code "
                               f"{proc.returncode}: {proc.stderr.strip()[-300:]}")
        found: Dict[str, int] = {}
        for line in proc.stdout.splitlines():
            line = line.strip()
            if not line:
                continue  # nothing is ready yet
            if ":" in line:
                name, slots = hostlib.parse_hosts(line)[0]
            else:
                if self.default_slots is None:
                    raise RuntimeError(f"--host-discovery-script printed {line!r} without slots: "
                                       "print host:slots, or give --slots-per-host")
                name, slots = hostlib.parse_hosts(f"{line}:{self.default_slots}")[0]
            found[name] = slots
        return found

    def describe(self) -> str:
        return f"--host-discovery-script {self.script}"


@dataclasses.dataclass
class _Blacklisting:
    count: int = 0
    until: float = float("inf")  # when it may come back (inf: never)
    why: str = ""


class HostPool:
    """What discovery reports, in order of first appearance, less blacklisted hosts."""

    def __init__(self, discovery: Discovery, cooldown: Optional[Tuple[int, int]] = None,
                 clock=time.monotonic):
        if cooldown is not None:
            low, high = cooldown
            if low < COOLDOWN_LIMITS[0] or high > COOLDOWN_LIMITS[1] or low > high:
                raise ValueError(f"--blacklist-cooldown-range {low} {high}: expected "
                                 f"{COOLDOWN_LIMITS[0]} <= MIN <= MAX <= {COOLDOWN_LIMITS[1]}")
        self.discovery = discovery
        self.cooldown = cooldown
        self.clock = clock
        self.order: List[str] = []
        self.slots: Dict[str, int] = {}
        self.blacklist: Dict[str, _Blacklisting] = {}
        self.last_error: Optional[str] = None

    def refresh(self, first: bool = False) -> None:
        """Ask discovery again; an error is raised on the first call, remembered after."""
        try:
            found = self.discovery.find()
        except (RuntimeError, ValueError) as e:
            if first:
                raise
            self.last_error = str(e)
            return
        self.last_error = None
        self.slots = found
        self.order = [h for h in self.order if h in found] + \
            [h for h in found if h not in self.order]

    def blacklist_host(self, host: str, why: str) -> None:
        entry = self.blacklist.setdefault(host, _Blacklisting())
        now = self.clock()
        if entry.until != float("inf") and entry.until > now:
            return  # still cooling down
        entry.count += 1
        entry.why = why
        if self.cooldown is None:
            entry.until = float("inf")
        else:
            low, high = self.cooldown
            delay = low * (1 << entry.count) + random.uniform(0, 1) * low
            entry.until = now + max(low, min(high, delay))

    def is_blacklisted(self, host: str) -> bool:
        entry = self.blacklist.get(host)
        return entry is not None and entry.until > self.clock()

    def available(self) -> List[hostlib.Host]:
        return [(h, self.slots[h]) for h in self.order if not self.is_blacklisted(h)]

    def can_change(self) -> bool:
        """False when waiting cannot bring more slots: fixed hosts, blacklisted for good."""
        if not isinstance(self.discovery, FixedHosts):
            return True
        return any(e.until != float("inf") for h, e in self.blacklist.items()
                   if h in self.slots and self.is_blacklisted(h))

    def describe(self) -> str:
        """'hl-a:2, hl-b:2 available; hl-c blacklisted (rank 3 was killed...)' for messages."""
        avail = self.available()
        text = (", ".join(f"{h}:{n}" for h, n in avail) or "no hosts") + " available"
        text += f" ({hostlib.total_slots(avail)} slots) from {self.discovery.describe()}"
        gone = [h for h in self.order if self.is_blacklisted(h)]
        if gone:
            now = self.clock()
            parts = []
            for h in gone:
                e = self.blacklist[h]
                back = "for good" if e.until == float("inf") else f"for {e.until - now:.0f} s more"
                parts.append(f"{h} ({e.why}; {back})")
            text += "; blacklisted: " + ", ".join(parts)
        if self.last_error:
            text += f"; last discovery error: {self.last_error}"
        return text


def assign(available: Sequence[hostlib.Host], max_np: Optional[int]) -> Tuple[hostlib.Host, ...]:
    """Fill hosts in order, up to max_np ranks: the hosts (with the slots used) of one start."""
    used, left = [], (max_np if max_np is not None else hostlib.total_slots(available))
    for name, slots in available:
        if left <= 0:
            break
        take = min(slots, left)
        used.append((name, take))
        left -= take
    return tuple(used)
