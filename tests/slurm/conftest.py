"""A real one-node Slurm cluster (munged, slurmctld, slurmd) for this directory's tests."""
import os
import subprocess
import sys

import pytest

from slurm_cluster import SlurmCluster, SlurmUnavailable


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    probe = subprocess.run([sys.executable, "-c", "import horolite.launcher"], cwd="/",
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip("horolite.launcher does not import outside the checkout (pip install -e .): "
                    + probe.stderr.strip()[-300:])
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except SlurmUnavailable as e:
        pytest.skip(f"cannot run a Slurm cluster here: {e}")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def jobdir(tmp_path):
    """A working directory for one job (outside the checkout: python -m horolite.launcher)."""
    os.chmod(tmp_path, 0o755)
    (tmp_path / "out").mkdir()
    return tmp_path
