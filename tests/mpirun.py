"""Run a pytest file under a real `mpirun -np N` and report every rank's result.

world="gloo" starts the ranks with `horolite-run --gloo` instead: no MPI, horolite's
own connections (horolite/world/).

Used by the matrix drivers (tests/test_matrix_*.py). Each rank runs the same
pytest file; the run fails if any rank fails. Ranks write their pytest output
to their own file so a failure shows which rank said what.
"""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANK_COUNTS = (1, 2, 3, 4)

# Every rank-side job's counts, summed over its ranks, for the terminal summary
# (tests/conftest.py): {"jobs", "passed", "skipped", "reasons": {reason: count}}.
RESULTS = {"jobs": 0, "passed": 0, "skipped": 0, "reasons": {}}


def gpu_count(devices, visible=None) -> int:
    """GPUs a job's ranks can see: `devices` lists the machine's GPUs (`nvidia-smi -L` lines,
    or /dev/nvidiaN names where there is no nvidia-smi), `visible` is CUDA_VISIBLE_DEVICES.
    Pure: the expected skips are judged from it, and tested with fake lists."""
    found = [d for d in devices if re.match(r"(GPU \d+:|(/dev/)?nvidia\d+$)", d.strip())]
    if visible is None:
        return len(found)
    wanted = [v for v in visible.replace(" ", "").split(",") if v]
    count = 0
    for v in wanted:  # CUDA stops at the first entry it cannot use
        if not (v.isdigit() and int(v) < len(found)) and not v.startswith(("GPU-", "MIG-")):
            break
        count += 1
    return count


class Machine:
    """What this machine has, for judging which rank-side skips are expected on it."""

    def __init__(self, gpus: int, tensorflow: bool, cupy: bool):
        self.gpus, self.tensorflow, self.cupy = gpus, tensorflow, cupy

    def __repr__(self) -> str:
        return f"Machine(gpus={self.gpus}, tensorflow={self.tensorflow}, cupy={self.cupy})"


def this_machine() -> Machine:
    devices = []
    if shutil.which("nvidia-smi"):
        proc = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
        devices = proc.stdout.splitlines() if proc.returncode == 0 else []
    if not devices:
        devices = glob.glob("/dev/nvidia[0-9]*")
    return Machine(gpu_count(devices, os.environ.get("CUDA_VISIBLE_DEVICES")),
                   importlib.util.find_spec("tensorflow") is not None,
                   importlib.util.find_spec("cupy") is not None)


def _native_off(env) -> bool:
    return env.get("HOROLITE_TF_NATIVE_OPS", "1").strip().lower() in ("0", "false", "no", "off")


def _shared_gpu_nccl(env) -> bool:
    return env.get("HOROLITE_TEST_NCCL_SHARED_GPU", "").strip().lower() in ("1", "true", "yes", "on")


def _sizes_listed(reason: str) -> list:
    """The job sizes a "run at np (2, 3) only" skip names."""
    return [int(n) for n in re.findall(r"\d+", reason.split(" only")[0])]


# The rank-side skips a job may have, each with when it is expected: (reason pattern,
# expected(np_, env, machine, reason)). Any other skip fails the job: a skip that is not
# expected on this machine (a hierarchical case on a layout where it should run, CuPy missing
# where it is installed, a GPU case on a machine with a GPU) hides a test that did not run.
EXPECTED_SKIPS = [
    (r"needs at least two ranks|a mismatch needs (at least )?two ranks|one rank has nobody"
     r"|one rank cannot disagree|needs a late rank|needs a joined rank|needs a rank outside a set"
     r"|needs a straggler",
     lambda np_, env, m, why: np_ < 2),
    (r"a subset of two ranks needs a third outside it", lambda np_, env, m, why: np_ < 3),
    (r"^needs 4 ranks$", lambda np_, env, m, why: np_ < 4),
    (r"^an mpi4py communicator needs a job MPI started$",
     lambda np_, env, m, why: env.get("HOROLITE_TEST_WORLD") == "gloo"),
    (r"^Adasum needs a power-of-two number of ranks$", lambda np_, env, m, why: np_ & (np_ - 1) != 0),
    # process sets: this rank is outside the set (and a rank inside it must run the test:
    # NEEDS_A_RANK_THAT_RAN_IT)
    (r"^not a member$", lambda np_, env, m, why: True),
    (r"^run at np \(.*\) only \(suite time\)$",
     lambda np_, env, m, why: np_ not in _sizes_listed(why)),
    (r"no NCCL transport here|no CUDA device|needs two visible GPUs|TensorFlow sees no GPU"
     r"|not every rank can use NCCL|NCCL does not load|cupy not installed",
     lambda np_, env, m, why: m.gpus == 0),
    (r"needs two visible GPUs", lambda np_, env, m, why: m.gpus < 2),
    # More ranks than GPUs, as users run them: NCCL is off (the job stages), so the cases
    # that need NCCL skip with its reason. With the test switch every rank has NCCL.
    (r"would share one GPU", lambda np_, env, m, why: np_ > m.gpus and not _shared_gpu_nccl(env)),
    (r"cupy not importable here", lambda np_, env, m, why: not m.cupy),
    (r"^TensorFlow is not installed here", lambda np_, env, m, why: not m.tensorflow),
    (r"HOROLITE_TF_NATIVE_OPS=0 in this run", lambda np_, env, m, why: _native_off(env)),
]
# Skips expected on some ranks only: the test must have passed on another rank of the job.
NEEDS_A_RANK_THAT_RAN_IT = [r"^not a member$"]


def unexpected_skips(skips, np_: int, env, machine: "Machine | None" = None,
                     passed=None) -> list:
    """The [test id, reason] skips that EXPECTED_SKIPS does not allow for this job.
    `passed`: the test ids that passed on some rank of the job (None: not judged)."""
    machine = machine or this_machine()
    bad = []
    for test, reason in skips:
        if not any(re.search(pattern, reason) and expected(np_, env, machine, reason)
                   for pattern, expected in EXPECTED_SKIPS):
            bad.append((test, reason))
        elif passed is not None and test not in passed and \
                any(re.search(pattern, reason) for pattern in NEEDS_A_RANK_THAT_RAN_IT):
            bad.append((test, f"{reason} (and no rank ran it)"))
    return bad


def _collect(outdir: str, np_: int, env) -> str:
    """Add the job's rank counts to RESULTS; return why they are wrong, or ""."""
    problems, skips, passed = [], [], set()
    for r in range(np_):
        path = os.path.join(outdir, f"rank{r}.json")
        if not os.path.exists(path):
            problems.append(f"rank {r} wrote no results")
            continue
        with open(path) as f:
            counts = json.load(f)
        RESULTS["passed"] += counts["passed"]
        passed.update(counts.get("passed_ids", ()))
        RESULTS["skipped"] += counts["skipped"]
        for test, reason in counts["skips"]:
            RESULTS["reasons"][reason] = RESULTS["reasons"].get(reason, 0) + 1
        skips += [(r, test, reason) for test, reason in counts["skips"]]
        if counts["passed"] == 0 and counts["skipped"] == 0:
            problems.append(f"rank {r} ran no test")
    RESULTS["jobs"] += 1
    bad = unexpected_skips([(t, why) for _, t, why in skips], np_, env, passed=passed)
    problems += [f"unexpected skip on this machine: {t}: {why}" for t, why in dict.fromkeys(bad)]
    return "\n".join(problems)


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


def gloo_command(np_: int) -> list:
    """horolite-run --gloo's prefix: np_ ranks started without MPI."""
    run = shutil.which("horolite-run", path=os.path.dirname(sys.executable) + os.pathsep
                       + os.environ.get("PATH", ""))
    if run is None:
        raise RuntimeError("no horolite-run found: pip install -e . first")
    return [run, "--gloo", "-np", str(np_)]


def run_pytest_file(path: str, np_: int, env: dict | None = None, timeout: float = 600,
                    pytest_args=(), world: str = "mpi") -> None:
    """Run `pytest path` on np_ ranks; raise AssertionError with every rank's log on failure."""
    outdir = tempfile.mkdtemp(prefix=f"horolite-np{np_}-")
    child_env = dict(os.environ)
    child_env.update(env or {})
    child_env["HOROLITE_TEST_OUTDIR"] = outdir
    child_env["HOROLITE_TEST_WORLD"] = world
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    cmd = (gloo_command(np_) if world == "gloo" else mpirun_command(np_)) + [
        sys.executable, os.path.join(ROOT, "tests", "rank_pytest.py"), path, *pytest_args]
    how = "horolite-run --gloo" if world == "gloo" else "mpirun"
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
            f"{os.path.relpath(path, ROOT)} failed under {how} -np {np_} (exit {code})\n"
            f"{out[-4000:]}\n" + "\n".join(logs))
    problems = _collect(outdir, np_, child_env)
    if problems:
        raise AssertionError(f"{os.path.relpath(path, ROOT)} under {how} -np {np_}:\n{problems}")
    shutil.rmtree(outdir, ignore_errors=True)
