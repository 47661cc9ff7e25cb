"""A real Slurm cluster (munged, slurmctld, two slurmd nodes on this host) for this
directory's tests. They skip where Slurm is not installed or not root; where it is, a
cluster that does not start (a daemon exiting, a timeout) fails them: a broken harness
must not pass as skips."""
import os
import subprocess
import sys

import pytest

from slurm_cluster import SlurmCluster, SlurmUnavailable, absent_reason


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    probe = subprocess.run([sys.executable, "-c", "import horolite.launcher"], cwd="/",
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip("horolite.launcher does not import outside the checkout (pip install -e .): "
                    + probe.stderr.strip()[-300:])
    absent = absent_reason()
    if absent:
        pytest.skip(f"cannot run a Slurm cluster here: {absent}")
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except SlurmUnavailable as e:
        cluster.stop()
        pytest.fail(f"Slurm is installed and this is root, but the cluster did not start: {e}",
                    pytrace=False)
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
