"""horolite-run in an MPI Operator launcher pod: no -np, no -H, the operator's hostfile variable.

The hostfile names this host (the workers' names would need Kubernetes); the
job runs under the real mpirun with the slots the hostfile gives.
"""
import os
import shutil
import sys

import pytest

from launcher_util import PROBE, marks

pytestmark = pytest.mark.skipif(
    shutil.which("mpirun", path=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    is None, reason="no mpirun installed")


@pytest.mark.parametrize("variable, line, size", [
    ("HYDRA_HOST_FILE", "localhost:2", 2),  # mpiImplementation: MPICH
    ("OMPI_MCA_orte_default_hostfile", "localhost slots=3", 3),  # mpiImplementation: OpenMPI
])
def test_operator_hostfile_gives_hosts_and_slots(run, tmp_path, variable, line, size):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(line + "\n")
    (tmp_path / "out").mkdir()
    r = run(sys.executable, PROBE, tmp_path / "out", env={variable: str(hostfile)})
    assert r.returncode == 0, r.stderr
    found = marks(tmp_path / "out")
    assert sorted(found) == list(range(size))
    assert all(m["size"] == size and m["allreduce"] == size for m in found.values())
