"""horolite-run must start, and say what to install, where no MPI library is installed:
its plain path must not load mpi4py's MPI (which fails to load without a library)."""
import subprocess
import sys


def test_the_launcher_loads_without_mpi4pys_mpi_module():
    code = ("import sys, horolite.launcher.main; "
            "assert 'mpi4py.MPI' not in sys.modules, sorted(m for m in sys.modules if 'mpi' in m)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
