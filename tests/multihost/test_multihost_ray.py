"""A Ray cluster across simulated hosts (a raylet on hl-a and on hl-b, real separate
hosts): RayExecutor's workers of two hosts meet over horolite's TCP connections between
hosts and shared memory within each, against NumPy; a worker that dies (the last rank's)
is named with its host's node in the driver."""
import json
import os
import secrets
import sys

import numpy as np
import pytest

from jobs import ROOT

pytest.importorskip("ray")

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
DRIVER = os.path.join(ROOT, "tests", "multihost", "ranks", "ray_driver.py")
PORT = 6390


def test_ray_executor_across_hosts(bed, tmp_path):
    a, b = bed.host("hl-a"), bed.host("hl-b")
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32),
               RAY_USAGE_STATS_ENABLED="0")
    common = ["--num-cpus=2", "--disable-usage-stats"]
    try:
        bed.on(a, [RAY, "start", "--head", f"--port={PORT}", f"--node-ip-address={a.address}",
                   "--include-dashboard=false", f"--temp-dir=/tmp/ray-{a.name}"] + common,
               env=env, timeout=180)
        bed.on(b, [RAY, "start", f"--address={a.address}:{PORT}",
                   f"--node-ip-address={b.address}", f"--temp-dir=/tmp/ray-{b.name}"] + common,
               env=env, timeout=180)
        out = tmp_path / "ray.json"
        proc = bed.on(a, [sys.executable, DRIVER, str(out)], check=False, timeout=300,
                      env=dict(env, RAY_ADDRESS=f"{a.address}:{PORT}"))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        seen = json.loads(out.read_text())
    finally:
        for host in (b, a):
            bed.on(host, [RAY, "stop", "--force"], check=False, env=env, timeout=120)
    got = seen["collectives"]
    assert [g["rank"] for g in got] == [0, 1, 2, 3]
    hosts = [g["host"] for g in got]  # each host's workers hold consecutive ranks
    assert hosts[0] == hosts[1] != hosts[2] == hosts[3] and set(hosts) == {"hl-a", "hl-b"}
    assert [(g["local_rank"], g["local_size"]) for g in got] == [(0, 2), (1, 2)] * 2
    want = np.sum([np.random.default_rng(50 + r).standard_normal(1000) for r in range(4)], 0)
    for g in got:
        np.testing.assert_allclose(g["sum"], want, rtol=1e-12)
        assert g["gathered"] == [float(r) for r in range(4) for _ in range(2)]
    last = bed.host(hosts[3])  # the host of the rank that dies
    assert seen["placed"][3].startswith(last.address + " node "), seen["placed"]
    assert seen["died"] and seen["died"].startswith(f"rank 3 (host {seen['placed'][3]}) died"), \
        seen["died"]
    assert seen["cause"].endswith("Error"), seen
