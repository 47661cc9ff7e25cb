"""horolite's own TCP connections start with the defaults wherever MPI starts: hosts on
routed subnets that each run Docker, hosts with a management and a data network, and a
stranger that connects to the port range during set-up.

These change the hosts' addresses, so they run on a bed of their own (two hosts),
rebuilt for each case.
"""
import os
import re
import subprocess
import sys
import time

import pytest

from bed import Bed, BedUnavailable, absent_reason
from jobs import HOROLITE_RUN, ROOT, stopped_at_exit

STEPS = os.path.join(ROOT, "tests", "multihost", "ranks", "fixed_steps.py")
# Every result checked against its known sum; "rank r: N steps" at the end.
ENV = {"HOROLITE_CROSS_HOST_TRANSPORT": "auto", "HOROLITE_LOG_LEVEL": "INFO"}


@pytest.fixture
def two_hosts():
    reason = absent_reason()
    if reason:
        pytest.skip(reason)
    try:
        b = Bed(2).start()
    except BedUnavailable as e:
        pytest.fail(f"root with the tools installed, but the bed did not start: {e}",
                    pytrace=False)
    try:
        yield b
    finally:
        b.close()


def run_steps(bed, hosts, env=None, steps=20):
    job = bed.run([HOROLITE_RUN, "-H", hosts, "python", STEPS, str(steps)],
                  timeout=240, env=dict(ENV, **(env or {})))
    ranks = sum(int(h.split(":")[1]) for h in hosts.split(","))
    steps = re.findall(r"rank (\d+): (\d+) steps", job.stdout)
    assert job.returncode == 0 and sorted(int(r) for r, _ in steps) == list(range(ranks)), \
        (job.stdout + job.stderr)[-4000:]
    return job


def docker_bridge(bed, host):
    """An idle Docker bridge as `docker` makes it (172.17.0.1/16), plus one container's
    cable in it, so that it has a carrier like a busy one."""
    for argv in (["ip", "link", "add", "docker0", "type", "bridge"],
                 ["ip", "addr", "add", "172.17.0.1/16", "dev", "docker0"],
                 ["ip", "link", "set", "docker0", "up"],
                 ["ip", "link", "add", "vethdk", "type", "veth", "peer", "name", "ctr0"],
                 ["ip", "link", "set", "vethdk", "master", "docker0", "up"],
                 ["ip", "link", "set", "ctr0", "up"]):
        bed.on(host, argv)


def test_routed_subnets_with_a_docker_bridge_on_every_host(two_hosts):
    """hl-a and hl-b on different subnets (hl-b's first address is on its own subnet,
    its second on hl-a's; hl-a reaches hl-b's through a route), each with docker0: the
    only subnet the hosts' first addresses share is docker0's, which must not be dialled."""
    bed = two_hosts
    bed.on("hl-a", ["ip", "addr", "flush", "dev", "eth0"])
    bed.on("hl-a", ["ip", "addr", "add", "198.18.0.11/28", "dev", "eth0"])
    bed.on("hl-a", ["ip", "route", "add", "198.18.0.32/28", "dev", "eth0"])
    bed.on("hl-b", ["ip", "addr", "flush", "dev", "eth0"])
    bed.on("hl-b", ["ip", "addr", "add", "198.18.0.34/28", "dev", "eth0"])
    bed.on("hl-b", ["ip", "addr", "add", "198.18.0.12/28", "dev", "eth0"])
    for host in ("hl-a", "hl-b"):
        docker_bridge(bed, host)
    job = run_steps(bed, "hl-a:2,hl-b:2")
    assert "horolite's TCP connections" in job.stderr  # (auto chose them)
    assert "172.17.0.1" not in job.stderr, job.stderr[-3000:]


def test_a_management_network_listed_first_and_a_data_network(two_hosts):
    """Each host's first interface is a slow management network; the host names resolve
    to the data network, its second. The job starts, and crosses hosts on the data
    network; named with HOROLITE_TCP_IFACE, the management network is taken instead."""
    bed = two_hosts
    data = bed.add_network("dat")
    for i, host in enumerate(("hl-a", "hl-b")):
        bed.on(host, ["ip", "addr", "flush", "dev", "eth0"])
        bed.on(host, ["ip", "addr", "add", f"198.18.0.{75 + i}/26", "dev", "eth0"])
        bed.on(host, ["tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", "100mbit",
                      "burst", "64kb", "latency", "50ms"])
        bed.plug(host, "eth1", data, f"198.18.0.{11 + i}/26")
    job = run_steps(bed, "hl-a:1,hl-b:1")
    chose = re.findall(r"connected to rank 1 \(host hl-b\) at ([0-9.]+)", job.stderr)
    assert chose == ["198.18.0.12"], job.stderr[-3000:]
    job = run_steps(bed, "hl-a:1,hl-b:1", env={"HOROLITE_TCP_IFACE": "eth0"})
    chose = re.findall(r"connected to rank 1 \(host hl-b\) at ([0-9.]+)", job.stderr)
    assert chose == ["198.18.0.76"], job.stderr[-3000:]


STRANGER = r"""
import socket, struct, sys, time
host, ports, seconds = sys.argv[1], range(45000, 45010), float(sys.argv[2])
held, end = [], time.time() + seconds
while time.time() < end:
    for port in ports:
        for how in ("silent", "reset", "garbage"):
            try:
                s = socket.create_connection((host, port), timeout=0.2)
            except OSError:
                continue
            if how == "silent":
                held.append(s)  # says nothing, stays connected
            elif how == "reset":
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()
            else:
                s.sendall(b"\x63\x74\x6c\x68" + b"\0" * 64)
                held.append(s)
    time.sleep(0.01)
print(f"stranger: {len(held)} connections held", flush=True)
"""


def test_a_stranger_on_the_port_range_during_set_up(two_hosts):
    """A client on hl-b connects to every port of the range on hl-b and on hl-a, over and
    over, through the set-up: silent connections it keeps open, resets and garbage. The job
    starts anyway and reduces correctly; the stranger did reach the listeners."""
    bed = two_hosts
    env = {"HOROLITE_TCP_PORT_RANGE": "45000-45009"}
    strangers = [bed.popen("hl-b", [sys.executable, "-c", STRANGER, address, "60"],
                           stdout=subprocess.PIPE, text=True)
                 for address in ("198.18.0.11", "198.18.0.12")]
    try:
        time.sleep(0.5)
        started = time.monotonic()
        job = run_steps(bed, "hl-a:2,hl-b:2", env=dict(env, HOROLITE_LOG_LEVEL="DEBUG"))
        took = time.monotonic() - started
    finally:
        for stranger in strangers:
            with stopped_at_exit(stranger):
                stranger.kill()
    assert took < 60, took
    # The strangers were there: set-up dropped their connections (and said so at debug).
    assert re.search(r"set-up dropped \d+ connection", job.stderr), job.stderr[-3000:]
