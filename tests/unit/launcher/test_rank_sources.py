"""Where ranks come from: Slurm allocations, the MPI Operator's hostfile, and their mpirun lines;
the singleton-trap check of init()."""
import pytest

from test_launcher_cli import WRAP, config, mpi

import importlib

slurm = importlib.import_module("horolite.launcher.slurm")
mpi_operator = importlib.import_module("horolite.launcher.mpi_operator")
supervise = importlib.import_module("horolite.launcher.supervise")
from horolite.failure import launch_check  # noqa: E402

ALLOC = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node[01-03],gpu7",
         "SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_NTASKS": "7"}


@pytest.mark.parametrize("text, names", [
    ("vm", ["vm"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("a1,b[9-11],c", ["a1", "b9", "b10", "b11", "c"]),
    ("r[1-2]n[08-09]", ["r1n08", "r1n09", "r2n08", "r2n09"]),
    ("x[7]-ib", ["x7-ib"]),
    ("node-[0098-0100]", ["node-0098", "node-0099", "node-0100"]),
])
def test_expand_nodelist(text, names):
    assert slurm.expand_nodelist(text) == names


@pytest.mark.parametrize("text, message", [
    ("node[1-", "unmatched"), ("node]1", "unmatched"), ("node[a-b]", "is not N or N-M"),
    ("node[5-2]", "backwards"), ("a,,b", "empty entry")])
def test_bad_nodelist(text, message):
    with pytest.raises(ValueError, match=message):
        slurm.expand_nodelist(text)


def test_tasks_per_node():
    assert slurm.parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert slurm.parse_tasks_per_node("4") == [4]
    with pytest.raises(ValueError, match="SLURM_TASKS_PER_NODE"):
        slurm.parse_tasks_per_node("2(3)")


def test_no_flags_inside_an_allocation_takes_it():
    c = config(["t"], environ=ALLOC)
    assert c.hosts == (("node01", 2), ("node02", 2), ("node03", 2), ("gpu7", 1))
    assert c.num_proc == 7 and c.start == "slurm"
    assert mpi.build_mpirun_command(c, mpi.MPICH, "mpirun", wrapper=WRAP) == [
        "mpirun", "-np", "7", "-launcher", "slurm", "-hosts", "node01:2,node02:2,node03:2,gpu7:1",
        *WRAP, "t"]
    assert mpi.build_mpirun_command(c, mpi.OPENMPI, "mpirun", wrapper=WRAP) == [
        "mpirun", "-np", "7", "--oversubscribe", "--prtemca", "plm", "slurm",
        "--host", "node01:2,node02:2,node03:2,gpu7:1", "--map-by", "slot", *WRAP, "t"]


def test_fewer_ranks_use_only_the_first_hosts():
    c = config(["-np", "3", "t"], environ=ALLOC)
    argv = mpi.build_mpirun_command(c, mpi.MPICH, "mpirun", wrapper=WRAP)
    assert argv[argv.index("-hosts") + 1] == "node01:2,node02:1"


def test_more_ranks_than_the_allocation_names_both_numbers():
    with pytest.raises(ValueError, match=r"-np 9 is more than the 7 slots of the Slurm allocation "
                                         r"\(job 42: SLURM_JOB_NODELIST=node\[01-03\],gpu7"):
        config(["-np", "9", "t"], environ=ALLOC)


def test_ntasks_caps_the_tasks_per_node():
    c = config(["t"], environ=dict(ALLOC, SLURM_NTASKS="3"))
    assert c.hosts == (("node01", 2), ("node02", 1)) and c.num_proc == 3


def test_allocation_that_does_not_add_up():
    with pytest.raises(ValueError, match="names 4 nodes.*gives 2 task counts"):
        config(["t"], environ=dict(ALLOC, SLURM_TASKS_PER_NODE="2,1"))


def test_flags_beat_the_allocation():
    c = config(["-H", "a:2", "t"], environ=ALLOC)
    assert c.hosts == (("a", 2),) and c.start == "ssh"
    assert "-launcher" not in mpi.build_mpirun_command(c, mpi.MPICH, "mpirun", wrapper=WRAP)


def test_no_source_is_this_host():
    c = config(["-np", "2", "t"], environ={"SLURM_JOB_ID": "1"})  # no node list: not an allocation
    assert c.hosts == () and c.start == "ssh"


@pytest.mark.parametrize("variable, text", [
    ("HYDRA_HOST_FILE", "job-worker-0.job.ns.svc:2\njob-worker-1.job.ns.svc:2\n"),
    ("OMPI_MCA_orte_default_hostfile",
     "job-worker-0.job.ns.svc slots=2\njob-worker-1.job.ns.svc slots=2\n"),
    ("I_MPI_HYDRA_HOST_FILE", "job-worker-0.job.ns.svc:2\njob-worker-1.job.ns.svc:2\n"),
])
def test_mpi_operator_hostfile_in_both_formats(tmp_path, variable, text):
    path = tmp_path / "hostfile"
    path.write_text(text)
    c = config(["t"], environ={variable: str(path)})
    assert c.hosts == (("job-worker-0.job.ns.svc", 2), ("job-worker-1.job.ns.svc", 2))
    assert c.num_proc == 4 and c.start == "ssh"
    with pytest.raises(ValueError, match=rf"-np 5 is more than the 4 slots of the MPI Operator "
                                         rf"hostfile .*\({variable}\)"):
        config(["-np", "5", "t"], environ={variable: str(path)})


def test_mpi_operator_default_path(tmp_path, monkeypatch):
    path = tmp_path / "hostfile"
    path.write_text("w-0.j.ns.svc:1\nw-1.j.ns.svc:1\n")
    monkeypatch.setattr(mpi_operator, "HOSTFILE", str(path))
    assert config(["t"]).hosts == (("w-0.j.ns.svc", 1), ("w-1.j.ns.svc", 1))
    monkeypatch.setattr(mpi_operator, "HOSTFILE", str(tmp_path / "absent"))
    assert config(["-np", "1", "t"]).hosts == ()


def test_unreadable_operator_hostfile(tmp_path):
    with pytest.raises(ValueError, match="cannot read the MPI Operator hostfile"):
        config(["t"], environ={"HYDRA_HOST_FILE": str(tmp_path / "none")})


def test_start_timeout_advice_follows_the_source():
    s = supervise.Supervisor(["x"], 2, ["n1", "n2"], start_timeout=5, start_help=slurm.HELP)
    s.ranks[0].started = True
    message = s._start_timeout_message()
    assert "missing ranks 1 (on n2)" in message and "scontrol show job" in message
    assert "ssh" not in message
    plain = supervise.Supervisor(["x"], 1, ["n1"], start_timeout=5)._start_timeout_message()
    assert "ssh without a password" in plain


# --- init()'s check: the launcher says N processes, MPI says 1 ---

@pytest.mark.parametrize("environ, who", [
    ({"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "2"}, "Slurm's srun started 4 processes"),
    ({"PMI_SIZE": "2", "PMI_RANK": "1"}, "MPICH's mpiexec (hydra) or srun --mpi=pmi2 started 2"),
    ({"OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_RANK": "0"}, "Open MPI's mpirun started 3"),
])
def test_singleton_under_a_launcher_is_refused(environ, who):
    with pytest.raises(launch_check.LaunchMismatchError) as e:
        launch_check.check(1, environ, lambda: "MPICH Version: 5.0.2\nMore")
    assert str(e.value).startswith(who)
    assert "as rank 0 of 1" in str(e.value)
    if "SLURM_STEP_NUM_TASKS" in environ:
        assert "srun --mpi=pmi2" in str(e.value) and "SLURM_PROCID=2" in str(e.value)
    else:
        assert "is not the MPI whose launcher started this process" in str(e.value)
    assert "(MPICH Version: 5.0.2)" in str(e.value)


def test_srun_pmi2_with_open_mpi_points_at_pmix():
    environ = {"PMI_SIZE": "2", "PMI_RANK": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "0"}
    message = launch_check.mismatch(1, environ, "Open MPI v5.0.11, package: Open MPI")
    assert message.startswith("MPICH's mpiexec (hydra) or srun --mpi=pmi2 started 2 processes")
    assert "srun --mpi=pmix" in message and "horolite-run python" in message


@pytest.mark.parametrize("world, environ", [
    (4, {"SLURM_STEP_NUM_TASKS": "4"}),  # srun --mpi=pmi2 wired right
    (1, {"SLURM_STEP_NUM_TASKS": "1"}),
    (1, {}),
    (4, {"PMI_SIZE": "4", "SLURM_STEP_NUM_TASKS": "1"}),  # mpiexec's ranks inside an srun step
    (1, {"PMI_SIZE": "1", "SLURM_STEP_NUM_TASKS": "4"}),  # the innermost launcher counts
    (1, {"SLURM_NTASKS": "4"}),  # a batch script's own process, not an srun task
])
def test_agreeing_launches_pass(world, environ):
    launch_check.check(world, environ, lambda: "x")


def test_inside_an_srun_step():
    step = dict(ALLOC, SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS="1", SLURM_NTASKS="1",
                SLURM_TASKS_PER_NODE="1", SLURM_JOB_CPUS_PER_NODE="4(x3),2")
    c = config(["t"], environ=step)
    assert c.hosts == (("node01", 4), ("node02", 4), ("node03", 4), ("gpu7", 2))
    assert c.start == "slurm" and c.mpirun_env == (("SLURM_OVERLAP", "1"),)
    with pytest.raises(ValueError, match="started by srun as one of 4 tasks"):
        config(["t"], environ=dict(step, SLURM_STEP_NUM_TASKS="4"))
    assert config(["t"], environ=ALLOC).mpirun_env == ()
