"""A real local Ray cluster for the tests: a head and a second node, each its own raylet.

``ray start`` starts both from this machine's venv (the ``ray`` command beside this
Python), with 2 CPUs each and a custom resource naming the node, so a test can place
work on either. Node b also says it has 2 GPUs (Ray hands out their ids "0" and "1";
no GPU is needed), so the GPU paths are tried on it. One cluster serves the whole
session (Ray's start takes seconds); ``close()`` stops them with ``ray stop --force``.
"""
from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from typing import List, Optional

__all__ = ["RayCluster", "RayClusterFailed", "use_session_token"]

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
NODE_CPUS = 2
NODE_B_GPUS = 2


def use_session_token() -> None:
    """Ray's token auth, with a token of this session's that the driver and both nodes have:
    a token a local ray.init() left in ~/.ray is then never the one sent. Called by
    tests/conftest.py, before any test module imports Ray (which reads the mode once, so a
    driver that imported Ray first would connect without a token)."""
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))


class RayClusterFailed(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayCluster:
    def __init__(self):
        self.port = _free_port()
        self.client_port = _free_port()  # Ray Client's server on the head (ray://)
        self.address: Optional[str] = None
        # The workers import the test modules' functions by name, as the driver does.
        here = os.path.dirname(os.path.abspath(__file__))
        path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
        # A node lost is noticed within about a second (Ray's default: 30 s or so).
        self.env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_DEDUP_LOGS="0",
                        PYTHONPATH=path, RAY_health_check_period_ms="500",
                        RAY_health_check_timeout_ms="1000",
                        RAY_health_check_failure_threshold="2")

    def _ray(self, args: List[str], timeout: float = 120) -> str:
        proc = subprocess.run([RAY] + args, capture_output=True, text=True, timeout=timeout,
                              env=self.env)
        if proc.returncode != 0:
            raise RayClusterFailed(f"ray {' '.join(args)} exited {proc.returncode}:\n"
                                   f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        return proc.stdout + proc.stderr

    def start(self) -> "RayCluster":
        if not os.path.exists(RAY):
            raise RayClusterFailed(f"no `ray` command beside {sys.executable}: "
                                   'pip install "horolite[ray]"')
        self._ray(["stop", "--force"])  # (a cluster left by an earlier run would be joined)
        common = [f"--num-cpus={NODE_CPUS}", "--disable-usage-stats"]
        self._ray(["start", "--head", f"--port={self.port}", "--include-dashboard=false",
                   f"--ray-client-server-port={self.client_port}",
                   '--resources={"hl_node_a": 100}'] + common)
        self.address = f"127.0.0.1:{self.port}"
        self.start_node_b()
        return self

    def start_node_b(self) -> None:
        self._ray(["start", f"--address={self.address}", '--resources={"hl_node_b": 100}',
                   f"--num-cpus={NODE_CPUS}", f"--num-gpus={NODE_B_GPUS}",
                   "--disable-usage-stats"])

    def node_b_raylet(self) -> int:
        """The pid of node b's raylet (the process named by its custom resource)."""
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if argv and argv[0].endswith(b"raylet") and any(b"hl_node_b" in a for a in argv):
                return int(pid)
        raise RayClusterFailed("node b's raylet is not running")

    def wait_for_nodes(self, ray, count: int = 2, seconds: float = 60) -> None:
        deadline = time.monotonic() + seconds
        while sum(1 for n in ray.nodes() if n["Alive"]) < count:
            if time.monotonic() > deadline:
                raise RayClusterFailed(f"{count} Ray nodes were not alive within {seconds} s: "
                                       f"{ray.nodes()}")
            time.sleep(0.2)

    def close(self) -> None:
        try:
            self._ray(["stop", "--force"], timeout=60)
        except (RayClusterFailed, subprocess.TimeoutExpired):
            pass
