"""Run a pytest file under a real `mpirun -np N` and report every rank's result.

Used by the matrix drivers (tests/test_matrix_*.py). Each rank runs the same
pytest file; the run fails if any rank fails. Ranks write their pytest output
to their own file so a failure shows which rank said what.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANK_COUNTS = (1, 2, 3, 4)


def mpirun_command(np_: int) -> list:
    """The mpirun prefix for the MPI in this environment (MPICH or Open MPI)."""
    mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if mpirun is None:
        raise RuntimeError("no mpirun found: install horolite (it depends on the mpich wheel)")
    version = subprocess.run([mpirun, "--version"], capture_output=True, text=True).stdout
    cmd = [mpirun, "-np", str(np_)]
    if "Open MPI" in version or "OpenRTE" in version or "PRRTE" in version:
        cmd += ["--oversubscribe"]
        if os.geteuid() == 0:
            cmd += ["--allow-run-as-root"]
    return cmd


def run_pytest_file(path: str, np_: int, env: dict | None = None, timeout: float = 600,
                    pytest_args=()) -> None:
    """Run `pytest path` on np_ ranks; raise AssertionError with every rank's log on failure."""
    outdir = tempfile.mkdtemp(prefix=f"horolite-np{np_}-")
    child_env = dict(os.environ)
    child_env.update(env or {})
    child_env["HOROLITE_TEST_OUTDIR"] = outdir
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    cmd = mpirun_command(np_) + [
        sys.executable, os.path.join(ROOT, "tests", "rank_pytest.py"), path, *pytest_args]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=child_env, capture_output=True, text=True,
                              timeout=timeout)
        code = proc.returncode
        out = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        code = "timeout"
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
    logs = []
    for r in range(np_):
        p = os.path.join(outdir, f"rank{r}.log")
        text = open(p).read() if os.path.exists(p) else "(no log)"
        logs.append(f"----- rank {r} of {np_} -----\n{text[-6000:]}")
    if code != 0:
        raise AssertionError(
            f"{os.path.relpath(path, ROOT)} failed under mpirun -np {np_} (exit {code})\n"
            f"{out[-4000:]}\n" + "\n".join(logs))
    shutil.rmtree(outdir, ignore_errors=True)
