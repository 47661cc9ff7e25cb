"""Without an MPI library, init() in a process an MPI launcher started raises one error that
names the fix, and one that nobody started as a rank is rank 0 of 1 on horolite's own world
(in subprocesses, since mpi4py looks for the library once per process)."""
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
    print("initialized", horolite.rank(), horolite.size(), horolite.gloo_enabled())
"""


def test_init_without_mpi_library_under_an_mpi_launcher_names_the_fix(tmp_path):
    env = dict(os.environ, MPI4PY_LIBMPI=str(tmp_path / "no" / "libmpi.so.12"),
               PMI_SIZE="2", PMI_RANK="1")
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                         timeout=120, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip()
    assert line.startswith("ERROR no MPI library found (mpi4py: cannot load MPI library)"), line
    assert 'pip install "horolite[mpich]"' in line and "\n" not in line


def test_init_without_mpi_library_and_no_launcher_is_one_rank_without_mpi(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "HYDRA"))}
    env["MPI4PY_LIBMPI"] = str(tmp_path / "no" / "libmpi.so.12")
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                         timeout=120, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["initialized", "0", "1", "True"], out.stdout + out.stderr


def test_import_needs_no_mpi_library(tmp_path):
    env = dict(os.environ, MPI4PY_LIBMPI=str(tmp_path / "no" / "libmpi.so.12"))
    out = subprocess.run([sys.executable, "-c", "import horolite, sys; "
                          "print(horolite.__version__, 'mpi4py.MPI' in sys.modules)"],
                         env=env, capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    import horolite
    assert out.returncode == 0 and out.stdout.split() == [horolite.__version__, "False"], out.stderr
