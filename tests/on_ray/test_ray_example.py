"""examples/ray_keras_digits.py on the session's Ray cluster, both ways it runs."""
import os
import re
import subprocess
import sys

import pytest

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "examples", "ray_keras_digits.py")


@pytest.mark.parametrize("how", [[], ["--executor"]], ids=["ray-train", "executor"])
def test_ray_keras_digits(ray_cluster, how, tmp_path):
    proc = subprocess.run([sys.executable, EXAMPLE, "--workers", "2",
                           "--storage-path", str(tmp_path)] + how,
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, RAY_ADDRESS=ray_cluster.address))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    found = re.search(r"test accuracy on 2 Ray workers: ([\d.]+)", proc.stdout)
    assert found and float(found.group(1)) > 0.9, proc.stdout
    if not how:  # Ray Train kept rank 0's model as the run's checkpoint
        saved = re.search(r"rank 0's model: (\S+)", proc.stdout).group(1)
        assert os.path.exists(saved) and saved.startswith(str(tmp_path))


def test_the_ray_step_benchmark_prints_every_figure(ray_cluster):
    proc = subprocess.run([sys.executable, os.path.join(os.path.dirname(EXAMPLE), "..", "bench",
                                                        "ray_step.py"),
                           "--np", "2", "--steps", "20", "--rounds", "1"],
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, RAY_ADDRESS=ray_cluster.address))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    row = proc.stdout.splitlines()[-1].split()
    assert row[0] == "2" and len(row) == 9, proc.stdout
    assert all(float(x) > 0 for x in row[1:4] + row[5:8]), proc.stdout
    assert row[4] in ("met", "missed") and row[8] in ("met", "missed"), proc.stdout
