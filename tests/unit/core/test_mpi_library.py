"""Without an MPI library, init() raises one error that names the fix (in a subprocess, since
mpi4py looks for the library once per process)."""
import os
import subprocess
import sys

SCRIPT = """
import horolite
try:
    horolite.init()
except horolite.MPILibraryNotFound as e:
    print("ERROR", e)
else:
    print("initialized")
"""


def test_init_without_mpi_library_names_the_fix(tmp_path):
    env = dict(os.environ, MPI4PY_LIBMPI=str(tmp_path / "no" / "libmpi.so.12"))
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                         timeout=120, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip()
    assert line.startswith("ERROR no MPI library found (mpi4py: cannot load MPI library)"), line
    assert 'pip install "horolite[mpich]"' in line and "\n" not in line


def test_import_needs_no_mpi_library(tmp_path):
    env = dict(os.environ, MPI4PY_LIBMPI=str(tmp_path / "no" / "libmpi.so.12"))
    out = subprocess.run([sys.executable, "-c", "import horolite, sys; "
                          "print(horolite.__version__, 'mpi4py.MPI' in sys.modules)"],
                         env=env, capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    import horolite
    assert out.returncode == 0 and out.stdout.split() == [horolite.__version__, "False"], out.stderr
