"""Jobs on the bed: horolite-run started on hl-a, and rank-side pytest files across hosts."""
import contextlib
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOROLITE_RUN = os.path.join(os.path.dirname(sys.executable), "horolite-run")


def launch(bed, hosts: str, argv, env=None, timeout: float = 300, extra=()):
    """``horolite-run -H hosts argv`` started on the first host (hl-a), from ROOT."""
    return bed.run([HOROLITE_RUN, "-H", hosts, *extra, *argv], timeout=timeout, env=env)


@contextlib.contextmanager
def stopped_at_exit(job):
    """`job` (a Popen), killed on the way out if it still runs (the block failed first)."""
    try:
        yield job
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()


def wait_for_file(job, path, seconds: float = 60) -> None:
    """Until `path` exists (a rank wrote it once it got going); fails if `job` (a Popen)
    ends or `seconds` pass first."""
    deadline = time.monotonic() + seconds
    while not os.path.exists(path) and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.path.exists(path), f"{os.path.basename(path)} never came: the job did not start"


def run_pytest_across(bed, hosts: str, path: str, env=None, pytest_args=(), timeout=300,
                      world: str = "mpi"):
    """A rank-side pytest file on every rank of ``hosts``; fails with every rank's log.
    world="gloo": started by horolite-run --gloo (no MPI), as tests/mpirun.py does."""
    outdir = tempfile.mkdtemp(prefix="horolite-multihost-")
    full_env = dict(env or {}, HOROLITE_TEST_OUTDIR=outdir, PYTHONUNBUFFERED="1",
                    HOROLITE_TEST_WORLD=world)
    old = os.getcwd()
    os.chdir(ROOT)
    try:
        proc = launch(bed, hosts, ["python", os.path.join(ROOT, "tests", "rank_pytest.py"), path,
                                   *pytest_args], env=full_env, timeout=timeout,
                      extra=["--gloo", "-x", "HOROLITE_TEST_OUTDIR", "-x", "HOROLITE_TEST_WORLD"]
                      if world == "gloo" else ())
    finally:
        os.chdir(old)
    if proc.returncode != 0:
        logs = []
        for name in sorted(os.listdir(outdir)):
            with open(os.path.join(outdir, name), errors="replace") as f:
                logs.append(f"----- {name} -----\n{f.read()[-5000:]}")
        raise AssertionError(f"{os.path.relpath(path, ROOT)} failed on {hosts} "
                             f"(exit {proc.returncode})\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}\n"
                             + "\n".join(logs))
    from mpirun import _collect  # the same rank-side counts and skip check as on one host
    ranks = sum(int(entry.split(":")[1]) for entry in hosts.split(","))
    problems = _collect(outdir, ranks, dict(os.environ, **full_env))
    if problems:
        raise AssertionError(f"{os.path.relpath(path, ROOT)} on {hosts}:\n{problems}")
    shutil.rmtree(outdir, ignore_errors=True)
    return proc
