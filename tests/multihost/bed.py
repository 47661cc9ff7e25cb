"""Simulated hosts on one machine, for multi-host jobs over real ssh.

Each host is a process tree in its own network, UTS (host name), PID and mount
namespaces, running a real sshd as its PID 1. Its ``eth0`` is one end of a
veth pair whose other end sits in a bridge inside a separate "switch" network
namespace, so nothing is added to the machine's own network: no interface, no
route, no address. Addresses come from 198.18.0.0/24 (reserved for network
benchmarks).

Inside each host's mount namespace:
- ``/sys`` is mounted again, so UCX (MPICH's network layer) sees ``eth0``;
- ``/proc/sys/kernel/random/boot_id`` is a fresh id: UCX takes processes with
  the same boot id for one node and tries shared memory between them;
- ``/etc/hosts`` names every host, and ``/etc/ssh/ssh_config`` logs in with a
  key made for this bed (no password, no known_hosts prompt).

Everything else (files, the venv, this checkout) is the machine's, so every
host has the same Python at the same path. ``close()`` kills each namespace's
first process; the kernel then ends every process of that PID namespace and
removes its network devices. Usable from pytest (``conftest.py``) and from a
script (``bench/multihost_bandwidth.py``)::

    with Bed(3) as bed:
        bed.run(["horolite-run", "-H", "hl-a:2,hl-b:2", "python", "train.py"])
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
import subprocess
import tempfile
import time
import uuid
from typing import Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
import needed_tools  # noqa: E402

__all__ = ["Bed", "BedUnavailable", "unavailable_reason"]

SUBNET = "198.18.0"
NAMES = ("hl-a", "hl-b", "hl-c", "hl-d")
SSHD = needed_tools.find("sshd") or "/usr/sbin/sshd"


class BedUnavailable(RuntimeError):
    """Namespaces, sshd or iproute2 are missing here (the tests skip with this reason)."""


def absent_reason() -> Optional[str]:
    """Why no bed can be built on this machine at all (not root, tools not installed):
    the tests skip with it. Any other failure to build the bed fails them."""
    if os.geteuid() != 0:
        return "simulated hosts need root (network, PID and mount namespaces)"
    return needed_tools.missing("unshare", "nsenter", "ip", "ssh", "ssh-keygen", "sshd")


def unavailable_reason() -> Optional[str]:
    """Why no bed can be built on this machine, or None."""
    absent = absent_reason()
    if absent:
        return absent
    probe = subprocess.run(["unshare", "--net", "--uts", "--pid", "--mount", "--fork",
                            "--mount-proc", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot make namespaces here: {probe.stderr.strip()}"
    return None


def _sh(argv: Sequence[str], **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        raise BedUnavailable(f"{' '.join(argv)} failed: {proc.stderr.strip()}")
    return proc


def _wait_for(predicate, what: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise BedUnavailable(f"timed out waiting for {what}")


def _first_child(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = f.read().split()
    except OSError:
        return 0
    return int(children[0]) if children else 0


class Host:
    def __init__(self, name: str, address: str, process: subprocess.Popen, init_pid: int):
        self.name = name
        self.address = address
        self.process = process  # `unshare`, in the host's network/UTS/mount namespaces
        self.init_pid = init_pid  # sshd: PID 1 of the host's PID namespace

    def nsenter(self) -> List[str]:
        return ["nsenter", "-t", str(self.init_pid), "-n", "-u", "-m", "-p"]

    def pids(self) -> List[int]:
        """Processes in this host's PID namespace other than its sshd (root's view)."""
        try:
            mine = os.readlink(f"/proc/{self.init_pid}/ns/pid")
        except OSError:
            return []
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != self.init_pid:
                try:
                    if os.readlink(f"/proc/{entry}/ns/pid") == mine:
                        found.append(int(entry))
                except OSError:
                    pass
        return found


class HostProcess(subprocess.Popen):
    """A command started in a host's namespaces. nsenter forks it and only waits: a signal
    sent here also goes to the command itself (a SIGINT reaches horolite-run's own
    handler), not only to nsenter."""

    def send_signal(self, sig: int) -> None:
        inner = _first_child(self.pid)
        if inner:
            try:
                os.kill(inner, sig)
            except ProcessLookupError:
                pass
        if sig != signal.SIGINT or not inner:  # (nsenter ends when its command does)
            super().send_signal(sig)


class Bed:
    """``hosts`` simulated hosts named hl-a, hl-b, ... at 198.18.0.11, .12, ..."""

    def __init__(self, hosts: int = 2):
        if not 1 <= hosts <= len(NAMES):
            raise ValueError(f"a bed has 1 to {len(NAMES)} hosts, not {hosts}")
        self.count = hosts
        self.hosts: List[Host] = []
        self.dir = ""
        self._switch: Optional[subprocess.Popen] = None
        self.bridge = f"hlbr{os.getpid()}"[:15]

    # ---- building ----
    def __enter__(self) -> "Bed":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> "Bed":
        reason = unavailable_reason()
        if reason:
            raise BedUnavailable(reason)
        self.dir = tempfile.mkdtemp(prefix=f"horolite-bed-{os.getpid()}-")
        try:
            self._write_files()
            self._switch = subprocess.Popen(["unshare", "--net", "sleep", "infinity"])
            _wait_for(lambda: self._in_new_netns(self._switch.pid), "the switch namespace")
            self._in_switch(["ip", "link", "add", self.bridge, "type", "bridge"])
            self._in_switch(["ip", "link", "set", self.bridge, "up"])
            for i in range(self.count):
                self.hosts.append(self._start_host(i))
            for host in self.hosts:
                _wait_for(lambda: self._sshd_up(host), f"sshd on {host.name}")
        except BaseException:
            self.close()
            raise
        return self

    def _write_files(self) -> None:
        d = self.dir
        for key in ("host_key", "id_ed25519"):
            _sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", os.path.join(d, key)])
        shutil.copy(os.path.join(d, "id_ed25519.pub"), os.path.join(d, "authorized_keys"))
        with open(os.path.join(d, "hosts"), "w") as f:
            f.write("127.0.0.1 localhost\n::1 localhost\n")
            for i in range(self.count):
                f.write(f"{SUBNET}.{11 + i} {NAMES[i]}\n")
        with open(os.path.join(d, "ssh_config"), "w") as f:
            f.write(f"Host *\n  IdentityFile {d}/id_ed25519\n  StrictHostKeyChecking no\n"
                    f"  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n  BatchMode yes\n"
                    f"  ConnectTimeout 5\n")
        with open(os.path.join(d, "sshd_config"), "w") as f:
            f.write(f"Port 22\nListenAddress 0.0.0.0\nHostKey {d}/host_key\n"
                    f"AuthorizedKeysFile {d}/authorized_keys\nPermitRootLogin prohibit-password\n"
                    f"PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
                    f"StrictModes no\nPidFile none\nMaxStartups 100\nMaxSessions 100\n")

    def _in_new_netns(self, pid: int) -> bool:
        try:
            return os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
        except OSError:
            return False

    def _in_switch(self, argv: Sequence[str]) -> None:
        _sh(["nsenter", "-t", str(self._switch.pid), "-n", *argv])

    def _start_host(self, i: int) -> Host:
        name, address, d = NAMES[i], f"{SUBNET}.{11 + i}", self.dir
        with open(os.path.join(d, f"boot_id.{name}"), "w") as f:
            f.write(str(uuid.uuid4()) + "\n")
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation directory
        script = (f"set -e; hostname {name}; mount -t sysfs sysfs /sys; "
                  f"mount --bind {d}/boot_id.{name} /proc/sys/kernel/random/boot_id; "
                  f"mount --bind {d}/hosts /etc/hosts; "
                  f"mount --bind {d}/ssh_config /etc/ssh/ssh_config; ip link set lo up; "
                  f"exec {SSHD} -D -e -f {d}/sshd_config")
        log = open(os.path.join(d, f"sshd.{name}.log"), "wb")
        process = subprocess.Popen(["unshare", "--net", "--uts", "--pid", "--mount", "--fork",
                                    "--mount-proc", "--kill-child", "sh", "-c", script],
                                   stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        log.close()
        init_pid = _wait_for(lambda: _first_child(process.pid), f"{name}'s first process")
        host = Host(name, address, process, init_pid)
        port = f"p{i}"
        self._in_switch(["ip", "link", "add", port, "type", "veth", "peer", "name", "eth0",
                         "netns", str(init_pid)])
        self._in_switch(["ip", "link", "set", port, "master", self.bridge, "up"])
        self.on(host, ["ip", "addr", "add", f"{address}/24", "dev", "eth0"])
        self.on(host, ["ip", "link", "set", "eth0", "up"])
        return host

    def _sshd_up(self, host: Host) -> bool:
        if host.process.poll() is not None:
            with open(os.path.join(self.dir, f"sshd.{host.name}.log"), errors="replace") as f:
                raise BedUnavailable(f"sshd on {host.name} exited: {f.read()[-2000:]}")
        probe = subprocess.run(host.nsenter() + ["ssh", host.name, "true"],
                               capture_output=True, timeout=15)
        return probe.returncode == 0

    # ---- using ----
    def host(self, name_or_index) -> Host:
        if isinstance(name_or_index, int):
            return self.hosts[name_or_index]
        return next(h for h in self.hosts if h.name == name_or_index)

    def on(self, host, argv: Sequence[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
        """Run argv inside a host (all its namespaces), from this process's directory."""
        host = host if isinstance(host, Host) else self.host(host)
        proc = subprocess.run(host.nsenter() + ["--wd=" + os.getcwd(), *argv],
                              capture_output=True, text=True, **kw)
        if check and proc.returncode != 0:
            raise RuntimeError(f"on {host.name}: {' '.join(argv)} failed ({proc.returncode}): "
                               f"{proc.stdout}{proc.stderr}")
        return proc

    def popen(self, host, argv: Sequence[str], **kw) -> subprocess.Popen:
        host = host if isinstance(host, Host) else self.host(host)
        return HostProcess(host.nsenter() + ["--wd=" + os.getcwd(), *argv], **kw)

    def run(self, argv: Sequence[str], host=0, timeout: float = 300,
            env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
        """argv on a host (the first by default): e.g. ``horolite-run -H ...``."""
        return self.on(host, argv, check=False, timeout=timeout,
                       env=None if env is None else dict(os.environ, **env))

    def link(self, host, up: bool) -> None:
        """Take a host's cable out of the switch (or put it back)."""
        i = self.hosts.index(host if isinstance(host, Host) else self.host(host))
        self._in_switch(["ip", "link", "set", f"p{i}", "up" if up else "down"])

    def add_network(self, name: str) -> str:
        """A second switch (a bridge beside the first), for hosts with two networks; its
        name, for plug()."""
        bridge = f"{self.bridge[:11]}{name}"[:15]
        self._in_switch(["ip", "link", "add", bridge, "type", "bridge"])
        self._in_switch(["ip", "link", "set", bridge, "up"])
        return bridge

    def plug(self, host, iface: str, network: str, address: str) -> None:
        """A second cable: `iface` on `host`, in the switch `network`, with `address`
        (CIDR)."""
        host = host if isinstance(host, Host) else self.host(host)
        port = f"q{self.hosts.index(host)}{network[-3:]}"[:15]
        self._in_switch(["ip", "link", "add", port, "type", "veth", "peer", "name", iface,
                         "netns", str(host.init_pid)])
        self._in_switch(["ip", "link", "set", port, "master", network, "up"])
        self.on(host, ["ip", "addr", "add", address, "dev", iface])
        self.on(host, ["ip", "link", "set", iface, "up"])

    def shape(self, rate: str = "1gbit") -> None:
        """Cap every host's outgoing link with a token bucket (both directions of each cable)."""
        for i, host in enumerate(self.hosts):
            self.on(host, ["tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", rate,
                           "burst", "256kb", "latency", "50ms"])
            self._in_switch(["tc", "qdisc", "replace", "dev", f"p{i}", "root", "tbf", "rate",
                             rate, "burst", "256kb", "latency", "50ms"])

    def leftovers(self) -> Dict[str, List[int]]:
        """Processes left on each host besides its sshd and the ones ssh sessions need."""
        return {h.name: h.pids() for h in self.hosts if h.pids()}

    def describe_leftovers(self) -> Dict[str, List[str]]:
        """``leftovers()`` with each process's command line, for a failure message."""
        return {host: [f"{pid} {_command_line(pid)}" for pid in pids]
                for host, pids in self.leftovers().items()}

    def kill_leftovers(self) -> None:
        for pids in self.leftovers().values():
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        while self.leftovers() and time.monotonic() < deadline:
            time.sleep(0.1)

    def close(self) -> None:
        for host in self.hosts:
            _kill(host.process)
        self.hosts = []
        if self._switch is not None:
            _kill(self._switch)
            self._switch = None
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = ""


def _command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return "(gone)"


def _kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGKILL)
    process.wait()


def main(argv=None) -> int:
    """``python tests/multihost/bed.py [--hosts N] [--shape 1gbit] [-- COMMAND]``: COMMAND
    (default: an interactive shell) on hl-a, with the other hosts reachable; then tear down."""
    import argparse
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--shape", metavar="RATE", help="cap every link, e.g. 1gbit (tc tbf)")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    with Bed(args.hosts) as bed:
        if args.shape:
            bed.shape(args.shape)
        names = ", ".join(f"{h.name} ({h.address})" for h in bed.hosts)
        print(f"bed: {names}; running on {bed.hosts[0].name}", file=sys.stderr, flush=True)
        return subprocess.call(bed.hosts[0].nsenter() + ["--wd=" + os.getcwd(),
                                                         *(command or [os.environ.get("SHELL", "sh")])])


if __name__ == "__main__":
    sys.exit(main())
