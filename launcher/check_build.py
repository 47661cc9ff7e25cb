"""``horolite-run --check-build``: what this installation can really do.

Every line comes from a real check in a subprocess (a broken library cannot
take the launcher down, and the checks run in parallel): TensorFlow is
imported, mpi4py reports the MPI library it is linked to, mpirun is asked for
its version, and NCCL counts only if CuPy imports, sees a GPU and loads NCCL (the
line also names the CUDA driver's version and the CuPy and NCCL wheels found).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import subprocess
import sys
from typing import Optional

from . import mpi
from .version import horolite_version

__all__ = ["Check", "run_checks", "format_report", "check_build"]

_TENSORFLOW = """
import json
try:
    import tensorflow as tf
except Exception as e:
    print(json.dumps({"ok": False, "reason": f"import tensorflow failed: {type(e).__name__}: {e}"}))
else:
    print(json.dumps({"ok": True, "detail": tf.__version__}))
"""

_MPI4PY = """
import json
try:
    import mpi4py
    mpi4py.rc.initialize = False  # no MPI_Init: only ask which library this is
    from mpi4py import MPI
except Exception as e:
    print(json.dumps({"ok": False, "reason": f"import mpi4py failed: {type(e).__name__}: {e}"}))
else:
    lib = " ".join(MPI.Get_library_version().strip().splitlines()[0].split())
    lib = lib.split(", package:")[0]  # Open MPI goes on with build details
    print(json.dumps({"ok": True, "detail": f"{lib}; mpi4py {mpi4py.__version__}"}))
"""

# One definition of "NCCL is usable": the runtime's own (CuPy imports, a GPU, NCCL loads);
# then the CUDA stack found (driver, CuPy and NCCL wheels), usable or not.
_NCCL = """
import json
from horolite.core.cuda_info import cuda_stack
from horolite.core.device import nccl_status
ok, text = nccl_status()
text = f"{text}; {cuda_stack()}"
print(json.dumps({"ok": ok, "detail": text} if ok else {"ok": False, "reason": text}))
"""


@dataclasses.dataclass(frozen=True)
class Check:
    ok: bool
    detail: str = ""
    reason: str = ""


def _probe(code: str, timeout: float) -> Check:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONWARNINGS="ignore")
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=timeout, env=env, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return Check(False, reason=f"the check did not finish within {timeout:.0f}s")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return Check(False, reason=f"the check crashed (exit {proc.returncode}): {tail}")
    data = json.loads(lines[-1])
    return Check(bool(data["ok"]), data.get("detail", ""), data.get("reason", ""))


def _mpirun() -> Check:
    try:
        found = mpi.find_mpi()
    except mpi.NoMPIError as e:
        return Check(False, reason=str(e))
    return Check(True, detail=f"{found.version} at {found.path}")


def run_checks(timeout: float = 120.0) -> dict:
    jobs = {"tensorflow": (_probe, _TENSORFLOW), "mpi4py": (_probe, _MPI4PY),
            "nccl": (_probe, _NCCL)}
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        futures = {name: pool.submit(fn, code, timeout) for name, (fn, code) in jobs.items()}
        futures["mpirun"] = pool.submit(_mpirun)
        return {name: f.result() for name, f in futures.items()}


def _line(ok: bool, name: str, note: Optional[str]) -> str:
    return f"    [{'X' if ok else ' '}] {name}" + (f" ({note})" if note else "")


def format_report(version: str, checks: dict) -> str:
    tf, mpi4py, nccl, mpirun = (checks[k] for k in ("tensorflow", "mpi4py", "nccl", "mpirun"))
    mpi_ok = mpi4py.ok and mpirun.ok
    if mpi_ok:
        mpi_note = f"{mpi4py.detail}; mpirun: {mpirun.detail}"
    else:
        mpi_note = "not available: " + "; ".join(c.reason for c in (mpi4py, mpirun) if not c.ok)
    lines = [
        f"horolite v{version}:",
        "",
        "Available Frameworks:",
        _line(tf.ok, "TensorFlow", tf.detail if tf.ok else f"not available: {tf.reason}"),
        "",
        "Available Controllers:",
        _line(mpi_ok, "MPI", mpi_note),
        "",
        "Available Tensor Operations:",
        _line(nccl.ok, "NCCL", nccl.detail if nccl.ok else f"not available: {nccl.reason}"),
        _line(mpi4py.ok, "MPI", mpi4py.detail if mpi4py.ok else f"not available: {mpi4py.reason}"),
    ]
    mismatch = _implementation_mismatch(mpi4py, mpirun)
    if mismatch:
        lines += ["", f"Warning: {mismatch}"]
    return "\n".join(lines)


def _implementation_mismatch(mpi4py: Check, mpirun: Check) -> Optional[str]:
    if not (mpi4py.ok and mpirun.ok):
        return None
    lib = mpi.detect_implementation(mpi4py.detail)
    run = mpi.detect_implementation(mpirun.detail)
    if lib and run and lib != run:
        return (f"mpi4py uses {lib} but mpirun is {run}: ranks would not form one job; "
                f"install one MPI wheel per environment")
    return None


def check_build() -> int:
    print(format_report(horolite_version(), run_checks()), flush=True)
    return 0
