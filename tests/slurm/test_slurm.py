"""horolite under a real Slurm (slurmctld, two slurmd and munged started by conftest.py).

Jobs of up to 2 tasks per node span both Slurm nodes (hl-node1, hl-node2: two
slurmd on this machine), so allocations come as ``hl-node[1-2]`` with
``SLURM_TASKS_PER_NODE=2(x2)`` or ``2,1``, and srun starts ranks through each
node's slurmd.

sbatch/salloc running horolite-run (ranks and hosts from the allocation), srun
straight into the ranks (--mpi=pmi2), srun without MPI (--mpi=none: the job's key, or
an error naming it),
scancel of a running job, and a failing rank named in the job's output.
"""
import os
import re
import shlex
import subprocess
import sys
import time

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
RANK_JOB = os.path.join(HERE, "rank_job.py")
LAUNCHER = f"{shlex.quote(sys.executable)} -m horolite.launcher"
PYTHON = shlex.quote(sys.executable)

sys.path.insert(0, os.path.join(os.path.dirname(HERE), "launcher"))
from launcher_util import marks  # noqa: E402


def check_ranks(outdir, size):
    """Every rank formed one job of `size` and computed the NumPy reference."""
    found = marks(outdir)
    assert sorted(found) == list(range(size)), found
    expected = (np.arange(5, dtype=np.float64) * sum(r + 1 for r in range(size))).tolist()
    for rank, mark in found.items():
        assert (mark["rank"], mark["size"]) == (rank, size)
        assert mark["sum"] == expected
        assert mark["ranks"] == list(range(size))
    return found


def sbatch(slurm, jobdir, ntasks, command, per_node=2):
    script = jobdir / "job.sh"
    script.write_text("#!/bin/bash\necho SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST "
                      f"SLURM_TASKS_PER_NODE=$SLURM_TASKS_PER_NODE\n{command}\n")
    r = slurm.cmd("sbatch", "--parsable", "-n", str(ntasks), f"--ntasks-per-node={per_node}",
                  f"--chdir={jobdir}", f"--output={jobdir}/job.out", "--job-name=horolite-test",
                  str(script))
    return r.stdout.strip().split(";")[0]


def check_nodes(found, per_node=2):
    """Ranks fill the Slurm nodes in order, per_node on each (the launchers' by-slot order)."""
    nodes = [found[r]["slurm"]["SLURMD_NODENAME"] for r in sorted(found)]
    assert len(set(nodes)) == -(-len(nodes) // per_node), nodes
    assert all(nodes[r] == nodes[r - r % per_node] for r in range(len(nodes))), nodes


def job_field(slurm, job_id, field):
    out = slurm.cmd("scontrol", "show", "job", job_id, check=False).stdout
    match = re.search(rf"\b{field}=(\S+)", out)
    return match.group(1) if match else None


def processes_with(token):
    out = subprocess.run(["ps", "-ww", "-eo", "pid,stat,args"], capture_output=True,
                         text=True).stdout
    return [line for line in out.splitlines()[1:]
            if token in line and not line.split()[1].startswith("Z") and "ps -ww" not in line]


def wait_gone(token, seconds):
    deadline = time.monotonic() + seconds
    while processes_with(token) and time.monotonic() < deadline:
        time.sleep(0.2)
    return processes_with(token)


@pytest.mark.parametrize("ntasks", [1, 2, 3, 4])
def test_sbatch_runs_horolite_run_on_the_allocation(slurm, jobdir, ntasks):
    """No -np, no -H: the ranks are the allocation's tasks, started through srun (no ssh)."""
    job = sbatch(slurm, jobdir, ntasks, f"{LAUNCHER} --verbose {PYTHON} {RANK_JOB} {jobdir}/out")
    state = slurm.wait_job(job)
    output = (jobdir / "job.out").read_text()
    assert state == "COMPLETED", output
    check_nodes(check_ranks(jobdir / "out", ntasks))
    command = [line for line in output.splitlines() if "rankwrap.py" in line]
    assert command and re.search(r"-launcher slurm|plm slurm", command[0]), output
    assert f"-np {ntasks} " in command[0]
    if ntasks > 2:  # a compressed node list and task counts (2(x2) for 3 tasks too: NTASKS caps)
        assert "SLURM_JOB_NODELIST=hl-node[1-2] SLURM_TASKS_PER_NODE=2(x2)" in output, output
        assert f" hl-node1:2,hl-node2:{ntasks - 2} " in command[0], command[0]


def test_salloc_with_fewer_ranks_than_the_allocation(slurm, jobdir):
    r = slurm.cmd("salloc", "-n", "4", "--ntasks-per-node=2", *shlex.split(LAUNCHER), "-np", "3",
                  sys.executable, RANK_JOB, str(jobdir / "out"), cwd=str(jobdir), timeout=120)
    assert r.returncode == 0, r.stderr
    check_nodes(check_ranks(jobdir / "out", 3))


def test_more_ranks_than_the_allocation_is_an_error(slurm, jobdir):
    r = slurm.cmd("salloc", "-n", "2", *shlex.split(LAUNCHER), "-np", "5", sys.executable,
                  RANK_JOB, str(jobdir / "out"), cwd=str(jobdir), check=False, timeout=120)
    assert r.returncode == 2
    assert re.search(r"-np 5 is more than the 2 slots of the Slurm allocation \(job \d+", r.stderr), \
        r.stderr
    assert not marks(jobdir / "out")


@pytest.mark.parametrize("ntasks", [1, 2, 3, 4])
def test_srun_starts_the_ranks_with_pmi2(slurm, jobdir, ntasks):
    r = slurm.cmd("srun", "-n", str(ntasks), "--ntasks-per-node=2", "--mpi=pmi2", sys.executable,
                  RANK_JOB, str(jobdir / "out"), cwd=str(jobdir), check=False, timeout=120)
    assert r.returncode == 0, r.stderr
    found = check_ranks(jobdir / "out", ntasks)
    check_nodes(found)
    assert {m["slurm"]["SLURM_PROCID"] for m in found.values()} == {str(r) for r in range(ntasks)}


def test_srun_without_pmi_and_without_a_key_names_both_ways_on_every_task(slurm, jobdir):
    """srun --mpi=none: no MPI between the tasks, so they meet without it, which needs the
    job's key; without one every task says how to give it, or to start MPI instead."""
    r = slurm.cmd("srun", "-n", "2", "--mpi=none", sys.executable, RANK_JOB, str(jobdir / "out"),
                  cwd=str(jobdir), check=False, timeout=120,
                  env=dict(slurm.env, HOROLITE_JOB_KEY=""))
    assert r.returncode != 0
    errors = [line for line in r.stderr.splitlines() if line.startswith("ValueError: rank ")]
    assert len(errors) == 2, r.stderr
    for task in (0, 1):
        assert any(e.startswith(f"ValueError: rank {task} of 2, started without MPI (Slurm")
                   for e in errors), errors
    assert all("HOROLITE_JOB_KEY" in e and "srun --mpi=pmi2" in e for e in errors)
    assert not marks(jobdir / "out")  # no rank got as far as training


@pytest.mark.parametrize("ntasks", [1, 2, 3, 4])
def test_srun_without_mpi_starts_the_ranks_with_the_jobs_key(slurm, jobdir, ntasks):
    """srun python train.py with no MPI between the tasks: horolite's own connections, the
    rendezvous on the step's first node (served by rank 0)."""
    r = slurm.cmd("srun", "-n", str(ntasks), "--ntasks-per-node=2", "--mpi=none", sys.executable,
                  RANK_JOB, str(jobdir / "out"), cwd=str(jobdir), check=False, timeout=120,
                  env=dict(slurm.env, HOROLITE_JOB_KEY=os.urandom(32).hex(),
                           HOROLITE_LOG_LEVEL="INFO"))
    assert r.returncode == 0, r.stderr[-3000:]
    found = check_ranks(jobdir / "out", ntasks)
    check_nodes(found)
    if ntasks > 1:
        assert "identity from Slurm (SLURM_PROCID); rendezvous at hl-node1:" in r.stderr, \
            r.stderr[-3000:]


def test_scancel_of_a_running_job_leaves_no_process(slurm, jobdir):
    job = sbatch(slurm, jobdir, 2,
                 f"{LAUNCHER} {PYTHON} {RANK_JOB} {jobdir}/out --sleep 300", per_node=1)
    deadline = time.monotonic() + 60
    while len(marks(jobdir / "out")) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(marks(jobdir / "out")) == 2, (jobdir / "job.out").read_text()
    assert processes_with(str(jobdir))
    slurm.cmd("scancel", job)
    assert slurm.wait_job(job, 60) == "CANCELLED"
    left = wait_gone(str(jobdir), 15)
    assert not left, "processes left behind:\n" + "\n".join(left)


def test_a_failing_rank_is_named_in_the_job_output(slurm, jobdir):
    job = sbatch(slurm, jobdir, 3,
                 f"{LAUNCHER} {PYTHON} {RANK_JOB} {jobdir}/out --fail-rank 1 --sleep 60")
    state = slurm.wait_job(job)
    output = (jobdir / "job.out").read_text()
    assert state == "FAILED", output
    assert job_field(slurm, job, "ExitCode") == "3:0"
    assert re.search(rf"horolite-run: job failed: rank 1 \(host {slurm.host}, pid \d+\) exited "
                     rf"with code 3", output), output
    assert not wait_gone(str(jobdir), 15)


def test_horolite_run_inside_an_srun_step(slurm, jobdir):
    """srun -n 1 (or srun --pty bash) then horolite-run: the job's CPUs are the slots, and
    mpirun's own srun overlaps the step instead of waiting for it forever."""
    r = slurm.cmd("salloc", "-n", "4", "--ntasks-per-node=2", "srun", "-n", "1",
                  *shlex.split(LAUNCHER), sys.executable, RANK_JOB, str(jobdir / "out"),
                  cwd=str(jobdir), check=False, timeout=120)
    assert r.returncode == 0, r.stderr
    check_nodes(check_ranks(jobdir / "out", 4))  # SLURM_JOB_CPUS_PER_NODE=2(x2)


def test_a_failed_srun_step_leaves_no_shared_memory(slurm, jobdir):
    """srun without horolite-run: the failing task exits without MPI_Finalize and srun
    stops the other (-K); the task that is stopped unlinks the host's MPICH segment on
    its way out (horolite/failure/shm_files.py), so nothing the tasks mapped from /dev/shm stays."""
    r = slurm.cmd("srun", "-K", "-n", "2", "--ntasks-per-node=2", "--mpi=pmi2", sys.executable,
                  RANK_JOB, str(jobdir / "out"), "--fail-rank", "1", "--sleep", "60",
                  cwd=str(jobdir), check=False, timeout=120)
    assert r.returncode != 0
    found = marks(jobdir / "out")
    assert len(found) == 2, r.stderr  # both ran collectives first
    mapped = {p for m in found.values() for p in m["shm"]}
    assert any("mpich_shm_" in p for p in mapped), found  # else nothing is checked
    time.sleep(1)
    left = [p for p in mapped if os.path.exists(p)]
    assert not left, f"left in /dev/shm: {left}\n{r.stderr[-2000:]}"
