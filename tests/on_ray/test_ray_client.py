"""Ray Client: a driver that reaches the cluster through ``ray://`` (not a node of it) runs
an elastic RayExecutor; the job's rendezvous is served by an actor on the cluster, since
the workers could not reach a server in such a driver."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("ray")

DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "client_driver.py")


def test_an_elastic_executor_runs_from_a_ray_client_driver(ray_cluster):
    proc = subprocess.run([sys.executable, DRIVER, f"ray://127.0.0.1:{ray_cluster.client_port}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    # rank 0 contributed 1, rank 1 contributed 2: NumPy's sum on every rank
    assert "sums [3.0, 3.0]" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
