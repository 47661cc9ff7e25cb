"""Where a rank without MPI learns who it is (horolite/world/identity.py)."""
import json
import logging

import pytest

from horolite.world.identity import (Identity, from_environ, job_key, log_once, slurm_port,
                                     under_mpi_launcher)
from horolite.world.slurm_lists import expand_hostlist, tasks_per_node

HOROLITE = {"HOROLITE_RANK": "3", "HOROLITE_SIZE": "8", "HOROLITE_LOCAL_RANK": "1",
            "HOROLITE_LOCAL_SIZE": "4", "HOROLITE_RENDEZVOUS_ADDR": "10.0.0.1",
            "HOROLITE_RENDEZVOUS_PORT": "4000"}
HOROVOD = {"HOROVOD_RANK": "2", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "0",
           "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "hvd-host",
           "HOROVOD_GLOO_RENDEZVOUS_PORT": "5000", "HOROVOD_HOSTNAME": "hostB"}
TORCHRUN = {"RANK": "5", "WORLD_SIZE": "6", "MASTER_ADDR": "master-0", "MASTER_PORT": "29500",
            "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "3"}
PET = {"PET_NODE_RANK": "1", "PET_NNODES": "3", "PET_NPROC_PER_NODE": "2",
       "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": "29400"}
SLURM = {"SLURM_PROCID": "4", "SLURM_NTASKS": "7", "SLURM_LOCALID": "0", "SLURM_NODEID": "2",
         "SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_JOB_NODELIST": "node[01-04,07],gpu2",
         "SLURM_JOB_ID": "12345", "SLURM_STEP_ID": "0"}
TF = {"TF_CONFIG": json.dumps({"cluster": {"chief": ["c0:2222"],
                                           "worker": ["w0:2222", "w1:2222", "w2:2222"]},
                               "task": {"type": "worker", "index": 1}})}


def test_horolite_set():
    assert from_environ(HOROLITE) == Identity(3, 8, 1, 4, "10.0.0.1", 4000, "HOROLITE_*",
                                              serve=False, host_label=None)


def test_horovod_gloo_set_with_its_hostname():
    assert from_environ(HOROVOD) == Identity(2, 4, 0, 2, "hvd-host", 5000,
                                             "Horovod Gloo (HOROVOD_*)", False, "hostB")


def test_torchrun_set():
    i = from_environ(TORCHRUN)
    assert (i.rank, i.size, i.local_rank, i.local_size) == (5, 6, 2, 3)
    assert (i.rendezvous_addr, i.rendezvous_port, i.serve) == ("master-0", 29500, False)
    assert i.source.startswith("torchrun")


def test_pytorchjob_without_local_names_is_one_process_per_pod_and_rank_0_serves():
    env = {k: v for k, v in TORCHRUN.items() if not k.startswith("LOCAL")}
    env["RANK"] = "0"
    i = from_environ(env)
    assert (i.rank, i.local_rank, i.local_size, i.serve) == (0, 0, 1, True)


def test_torchrun_with_half_the_local_names_is_an_error():
    env = {k: v for k, v in TORCHRUN.items() if k != "LOCAL_WORLD_SIZE"}
    with pytest.raises(ValueError, match="LOCAL_RANK=2 is set without LOCAL_WORLD_SIZE"):
        from_environ(env)


def test_kubeflow_trainer_pet_set():
    i = from_environ(dict(PET, LOCAL_RANK="1"))
    assert (i.rank, i.size, i.local_rank, i.local_size) == (3, 6, 1, 2)
    assert (i.rendezvous_addr, i.rendezvous_port) == ("job-node-0-0.job", 29400)
    assert i.source == "Kubeflow Trainer (PET_*)" and not i.serve
    first = from_environ(dict(PET, PET_NODE_RANK="0", LOCAL_RANK="0"))
    assert (first.rank, first.local_rank, first.serve) == (0, 0, True)


def test_kubeflow_trainer_needs_a_number_of_processes_per_node():
    with pytest.raises(ValueError, match="PET_NPROC_PER_NODE='auto'"):
        from_environ(dict(PET, PET_NPROC_PER_NODE="auto"))
    assert from_environ(dict(PET, PET_NNODES="3:3", LOCAL_RANK="0")).size == 6


def test_slurm_set():
    i = from_environ(SLURM)
    assert (i.rank, i.size, i.local_rank, i.local_size) == (4, 7, 0, 2)
    assert i.rendezvous_addr == "node01" and i.source == "Slurm (SLURM_PROCID)"
    assert 20000 <= i.rendezvous_port <= 29999 and not i.serve
    last = from_environ(dict(SLURM, SLURM_PROCID="6", SLURM_NODEID="3"))
    assert last.local_size == 1


def test_slurm_port_is_the_same_for_every_task_of_a_step_and_differs_between_steps():
    ports = {from_environ(dict(SLURM, SLURM_PROCID=str(r), SLURM_LOCALID="0")).rendezvous_port
             for r in range(7)}
    assert len(ports) == 1
    assert slurm_port(dict(SLURM, SLURM_STEP_ID="1")) != slurm_port(SLURM) or \
        slurm_port(dict(SLURM, SLURM_STEP_ID="2")) != slurm_port(SLURM)
    assert from_environ(dict(SLURM, HOROLITE_RENDEZVOUS_PORT="4100")).rendezvous_port == 4100


def test_slurm_prefers_the_steps_own_names():
    env = dict(SLURM, SLURM_STEP_NODELIST="gpu[3-4]", SLURM_STEP_TASKS_PER_NODE="4,3",
               SLURM_STEP_NUM_TASKS="7", SLURM_NODEID="0", SLURM_NTASKS="16")
    i = from_environ(env)
    assert (i.rendezvous_addr, i.local_size, i.size) == ("gpu3", 4, 7)


def test_slurm_ntasks_per_node_is_one_count_for_every_node():
    env = {k: v for k, v in SLURM.items() if k != "SLURM_TASKS_PER_NODE"}
    env.update(SLURM_NTASKS_PER_NODE="3", SLURM_NTASKS="9", SLURM_PROCID="7", SLURM_LOCALID="1")
    assert from_environ(env).local_size == 3


def test_a_batch_script_is_no_slurm_rank():
    env = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}
    assert from_environ(env) is None


def test_hostlist_expansion():
    assert expand_hostlist("node[01-04,07],gpu2") == [
        "node01", "node02", "node03", "node04", "node07", "gpu2"]
    assert expand_hostlist("a[8-10]") == ["a8", "a9", "a10"]
    assert expand_hostlist("r[1-2]-n[1-2]") == ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]
    assert expand_hostlist("solo") == ["solo"]
    for bad in ("n[1-", "n[3-1]", "n[a-b]", "n]1["):
        with pytest.raises(ValueError):
            expand_hostlist(bad)


def test_tasks_per_node_parsing():
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("4") == [4]
    with pytest.raises(ValueError, match="x3"):
        tasks_per_node("x3")


def test_malformed_slurm_lists_name_the_variable():
    with pytest.raises(ValueError, match="SLURM_TASKS_PER_NODE='2\\(x'"):
        from_environ(dict(SLURM, SLURM_TASKS_PER_NODE="2(x"))
    with pytest.raises(ValueError, match="SLURM_JOB_NODELIST="):
        from_environ(dict(SLURM, SLURM_JOB_NODELIST="node[01-"))


def test_tf_config():
    i = from_environ(TF)
    assert (i.rank, i.size, i.local_rank, i.local_size) == (2, 4, 0, 1)
    assert (i.rendezvous_addr, i.rendezvous_port, i.source) == ("c0", 2223, "TF_CONFIG")
    chief = json.loads(TF["TF_CONFIG"])
    chief["task"] = {"type": "chief", "index": 0}
    i = from_environ({"TF_CONFIG": json.dumps(chief), "HOROLITE_RENDEZVOUS_PORT": "7000",
                      "HOROLITE_LOCAL_RANK": "0", "HOROLITE_LOCAL_SIZE": "2"})
    assert (i.rank, i.rendezvous_port, i.local_size, i.serve) == (0, 7000, 2, True)


def test_tf_config_errors():
    with pytest.raises(ValueError, match="TF_CONFIG is not valid JSON"):
        from_environ({"TF_CONFIG": "{cluster"})
    ps = json.loads(TF["TF_CONFIG"])
    ps["task"] = {"type": "ps", "index": 0}
    with pytest.raises(ValueError, match="'ps' is not a horolite rank"):
        from_environ({"TF_CONFIG": json.dumps(ps)})
    ps["task"] = {"type": "worker", "index": 3}
    with pytest.raises(ValueError, match="TF_CONFIG task index=3"):
        from_environ({"TF_CONFIG": json.dumps(ps)})


def test_precedence_first_complete_set_wins():
    everything = {**TF, **SLURM, **PET, **TORCHRUN, **HOROVOD, **HOROLITE,
                  "TORCHELASTIC_RUN_ID": "x"}  # (PET_* with RANK: torchrun in Trainer's pods)
    order = ["HOROLITE_*", "Horovod Gloo", "torchrun", "Kubeflow", "Slurm", "TF_CONFIG"]
    sets = [HOROLITE, HOROVOD, TORCHRUN, PET, SLURM, TF]
    for i, expected in enumerate(order):
        env = {k: v for k, v in everything.items() if not any(k in s for s in sets[:i])}
        assert from_environ(env).source.startswith(expected), expected
    incomplete = dict(everything)
    del incomplete["HOROLITE_RENDEZVOUS_ADDR"]  # (an incomplete set is skipped)
    assert from_environ(incomplete).source.startswith("Horovod")


def test_no_set_is_none():
    assert from_environ({}) is None
    assert from_environ({"RANK": "1", "WORLD_SIZE": "2"}) is None
    assert from_environ({"HOROLITE_RENDEZVOUS_PORT": "5"}) is None


@pytest.mark.parametrize("env, words", [
    ({"HOROLITE_RANK": "x"}, "HOROLITE_RANK='x' is not an integer"),
    ({"HOROLITE_RANK": "8"}, "HOROLITE_RANK=8 is not a valid rank for HOROLITE_SIZE=8"),
    ({"HOROLITE_LOCAL_RANK": "4"}, "HOROLITE_LOCAL_RANK=4 is not a valid local rank for "
                                   "HOROLITE_LOCAL_SIZE=4"),
    ({"HOROLITE_SIZE": "0"}, "HOROLITE_SIZE=0 must be at least 1"),
    ({"HOROLITE_RENDEZVOUS_PORT": "70000"}, "HOROLITE_RENDEZVOUS_PORT=70000 is not a TCP port"),
])
def test_malformed_values_name_the_variable(env, words):
    with pytest.raises(ValueError) as e:
        from_environ(dict(HOROLITE, **env))
    assert words in str(e.value)
    with pytest.raises(ValueError, match="RANK='one' is not an integer"):
        from_environ(dict(TORCHRUN, RANK="one"))
    with pytest.raises(ValueError, match="SLURM_PROCID=7 is not a valid rank for SLURM_NTASKS=7"):
        from_environ(dict(SLURM, SLURM_PROCID="7"))


@pytest.mark.parametrize("mpi", [
    {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "1"},
    {"PMI_SIZE": "4", "PMI_RANK": "1", "MPI_LOCALNRANKS": "2"},  # MPICH's hydra
    {"PMI_SIZE": "8", "PMI_RANK": "3"},  # (not srun's: SLURM_PROCID is 4)
    {"PMIX_RANK": "0"},
    {"MV2_COMM_WORLD_SIZE": "2"},
])
def test_an_mpi_launcher_hides_the_scheduler_sets_but_not_the_launchers(mpi):
    assert under_mpi_launcher(mpi)
    for scheduler in (SLURM, TORCHRUN, PET, TF):
        assert from_environ(dict(scheduler, **mpi)) is None
        assert from_environ(dict(scheduler, **HOROVOD, **mpi)).source.startswith("Horovod")
    assert from_environ(dict(HOROLITE, **mpi)).source == "HOROLITE_*"


def test_sruns_own_pmi_is_not_an_mpi_launcher():
    assert not under_mpi_launcher({})
    assert not under_mpi_launcher(SLURM)
    own = dict(SLURM, PMIX_RANK="4", PMI_RANK="4", PMI_SIZE="7")  # srun --mpi=pmix / pmi2
    assert not under_mpi_launcher(own)
    assert from_environ(own).source.startswith("Slurm")


def test_log_once(caplog):
    ident = from_environ(dict(HOROLITE, HOROLITE_RANK="6"))
    logger = logging.getLogger("test.identity")
    with caplog.at_level(logging.INFO, logger="test.identity"):
        log_once(ident, logger)
        log_once(ident, logger)
    lines = [r.getMessage() for r in caplog.records if r.name == "test.identity"]
    assert len(lines) == 1 and "rank 6 of 8" in lines[0] and "HOROLITE_*" in lines[0]


def test_job_key_inline_and_file(tmp_path):
    assert job_key({}) is None
    assert job_key({"HOROLITE_JOB_KEY": "ab" * 16}) == b"\xab" * 16
    raw = tmp_path / "raw"
    raw.write_bytes(bytes(range(200, 232)))
    assert job_key({"HOROLITE_JOB_KEY_FILE": str(raw)}) == bytes(range(200, 232))
    text = tmp_path / "hex"
    text.write_text("00ff" * 8 + "\n")
    assert job_key({"HOROLITE_JOB_KEY_FILE": str(text)}) == b"\x00\xff" * 8


@pytest.mark.parametrize("env, words", [
    ({"HOROLITE_JOB_KEY": "zz" * 16}, "not hexadecimal"),
    ({"HOROLITE_JOB_KEY": "ab" * 8 + "a"}, "not hexadecimal"),
    ({"HOROLITE_JOB_KEY": "ab" * 15}, "holds 15 bytes; the job key needs at least 16"),
    ({"HOROLITE_JOB_KEY_FILE": "/nonexistent/key"}, "/nonexistent/key) cannot be read"),
    ({"HOROLITE_JOB_KEY": "ab" * 16, "HOROLITE_JOB_KEY_FILE": "/k"}, "both"),
])
def test_malformed_job_keys_say_what_is_wrong(env, words):
    with pytest.raises(ValueError) as e:
        job_key(env)
    assert words in str(e.value)


def test_a_short_key_file_is_refused(tmp_path):
    short = tmp_path / "short"
    short.write_bytes(b"\x01" * 10)
    with pytest.raises(ValueError, match="holds 10 bytes"):
        job_key({"HOROLITE_JOB_KEY_FILE": str(short)})
