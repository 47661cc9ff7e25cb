"""Where a scheduler-started job's rendezvous is served (identity.py with
rendezvous_ports.py): ports every rank derives alike, never torchrun's own, a few
candidates where a port may be taken, the override for every source, and a pod that
Kubeflow counts as several processes named at once."""
import json

import pytest

from horolite.world.identity import from_environ, slurm_port

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "master-0", "MASTER_PORT": "29500",
            "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
UNDER_TORCHRUN = dict(TORCHRUN, TORCHELASTIC_RUN_ID="job7", TORCHELASTIC_RESTART_COUNT="0")
SLURM = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1",
         "SLURM_TASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "node01", "SLURM_JOB_ID": "991",
         "SLURM_STEP_ID": "3"}
PYTORCHJOB = {"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "job-master-0",
              "MASTER_PORT": "23456", "PET_NPROC_PER_NODE": "2", "PET_NNODES": "2",
              "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "job-master-0",
              "PET_MASTER_PORT": "23456"}


def test_under_torchrun_the_rendezvous_is_beside_the_agents_store():
    i = from_environ(UNDER_TORCHRUN)
    assert i.rendezvous_port == 29501 and i.candidates() == (29501, 29502, 29503, 29504)
    assert "MASTER_PORT+1" in i.port_from
    for only in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE"):
        assert from_environ(dict(TORCHRUN, **{only: "x"})).rendezvous_port == 29501
    # Without torchrun (a PyTorchJob pod's one process) nobody else serves MASTER_PORT.
    assert from_environ(TORCHRUN).candidates() == (29500,)


@pytest.mark.parametrize("env", [UNDER_TORCHRUN, SLURM, PYTORCHJOB | {"PET_NPROC_PER_NODE": "1"},
                                 {k: v for k, v in PYTORCHJOB.items() if k[:4] == "PET_"}
                                 | {"LOCAL_RANK": "0"}])
def test_the_override_is_the_only_candidate_for_every_source(env):
    i = from_environ(dict(env, HOROLITE_RENDEZVOUS_PORT="4100"))
    assert i.candidates() == (4100,) and i.port_from == "HOROLITE_RENDEZVOUS_PORT"


def test_slurm_derives_distinct_candidates_alike_on_every_task():
    ports = {from_environ(dict(SLURM, SLURM_PROCID=str(r), SLURM_LOCALID=str(r))).candidates()
             for r in range(2)}
    (found,) = ports
    assert len(set(found)) == 4 and all(20000 <= p <= 29999 for p in found)
    assert found[0] == slurm_port(SLURM)
    assert from_environ(dict(SLURM, SLURM_STEP_ID="4")).candidates() != found


def test_tf_config_candidates_follow_the_first_address():
    tf = {"TF_CONFIG": json.dumps({"cluster": {"chief": ["c0:2222"], "worker": ["w0:2222"]},
                                   "task": {"type": "worker", "index": 0}})}
    assert from_environ(tf).candidates() == (2223, 2224, 2225, 2226)


def test_a_pytorchjob_pod_counted_as_two_processes_but_run_as_one_is_named_with_the_fix():
    with pytest.raises(ValueError, match=r"PET_NPROC_PER_NODE=2: .* WORLD_SIZE.*without "
                                         r"torchrun.*nprocPerNode to 1"):
        from_environ(PYTORCHJOB)
    # Under torchrun the same pod's processes are fine (RANK is torchrun's then).
    assert from_environ(dict(PYTORCHJOB, TORCHELASTIC_RUN_ID="x")).size == 4
    pet_only = {k: v for k, v in PYTORCHJOB.items() if k.startswith("PET_")}
    with pytest.raises(ValueError, match="PET_NPROC_PER_NODE=2: .*without torchrun"):
        from_environ(pet_only)


def test_a_key_file_others_can_read_is_warned_about_once(tmp_path, caplog):
    from horolite.world import identity
    path = tmp_path / "key"
    path.write_bytes(b"k" * 32)
    path.chmod(0o644)
    env = {"HOROLITE_JOB_KEY_FILE": str(path)}
    with caplog.at_level("WARNING", logger="horolite.world.identity"):
        assert identity.job_key(env) == b"k" * 32
        identity.job_key(env)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "mode 0644" in said[0] and "chmod 600" in said[0], said
    path.chmod(0o600)
    caplog.clear()
    with caplog.at_level("WARNING", logger="horolite.world.identity"):
        identity.job_key(env)
    assert not caplog.records
