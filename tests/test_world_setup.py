"""Jobs started without mpirun by what a scheduler gives each process (torchrun's and
PyTorchJob's variables, Kubeflow Trainer's PET_*, TF_CONFIG, a Kubernetes Indexed Job as
docs/clusters.md writes it), and the rendezvous under strangers and a missing rank.

Each job's ranks are plain processes started here with only those variables and the
job's key; every rank checks its collectives against NumPy (world_rank/reduce_and_mark.py).
"""
import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from mpirun import ROOT

RANK_SCRIPT = os.path.join(ROOT, "tests", "world_rank", "reduce_and_mark.py")
KEY = os.urandom(32).hex()
# A process of this suite may run under mpirun's variables: none may leak into the ranks.
LEAKS = ("PMI_", "OMPI_", "PMIX_", "HYDRA_", "MPI_LOCAL", "SLURM_", "HOROLITE_", "HOROVOD_",
         "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "PET_", "TF_CONFIG")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(LEAKS)}
    env.update(PYTHONUNBUFFERED="1", HOROLITE_JOB_KEY=KEY, TF_CPP_MIN_LOG_LEVEL="3",
               HOROLITE_LOG_LEVEL="INFO")
    env.update(extra)
    return env


def start(envs, outdir):
    return [subprocess.Popen([sys.executable, RANK_SCRIPT, str(outdir)], env=env, cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for env in envs]


def finish(procs, timeout=120):
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            out += "\n(killed: timed out)"
        outs.append(out)
    return outs


def marks(outdir, n):
    return [(outdir / f"rank.{r}").read_text() if (outdir / f"rank.{r}").exists() else None
            for r in range(n)]


def torchrun_env(r, n, port, local=True):
    return clean_env(RANK=str(r), WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(port),
                     **({"LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(n)} if local else {}))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_torchrun_variables_start_a_job(n, tmp_path):
    port = free_port()
    procs = start([torchrun_env(r, n, port) for r in range(n)], tmp_path)
    outs = finish(procs)
    assert [p.returncode for p in procs] == [0] * n, "\n".join(outs)[-4000:]
    assert marks(tmp_path, n) == [f"{r} {n} {r} {n} ok" for r in range(n)]
    assert "identity from torchrun" in outs[0], outs[0][-2000:]  # (said once, at INFO)


def test_a_pair_quiet_for_15_s_is_not_lost(tmp_path):
    # With the stall check off nothing crosses the world's connections between the two
    # allreduces: only a connection without a timeout survives the silence.
    port = free_port()
    script = os.path.join(ROOT, "tests", "world_rank", "quiet_then_reduce.py")
    procs = [subprocess.Popen([sys.executable, script, str(tmp_path), "15"], cwd=ROOT,
                              env=dict(torchrun_env(r, 2, port), HOROLITE_STALL_CHECK_DISABLE="1"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    # Meanwhile rank 0's rendezvous is closed: the world formed, and nothing is elastic.
    deadline = time.monotonic() + 60
    while not (tmp_path / "formed.0").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    outs = finish(procs)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outs)[-4000:]
    assert marks(tmp_path, 2) == ["0 2 quiet ok", "1 2 quiet ok"]


def test_under_torchrun_rank_0_serves_beside_the_agents_store(tmp_path):
    # torchrun's agent serves its store on MASTER_PORT for the whole job: a listener
    # stands in for it here (tests/test_world_torchrun.py runs the real one).
    with socket.create_server(("127.0.0.1", 0)) as agent_store:
        port = agent_store.getsockname()[1]
        procs = start([dict(torchrun_env(r, 2, port), TORCHELASTIC_RUN_ID="job7")
                       for r in range(2)], tmp_path)
        outs = finish(procs)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outs)[-4000:]
    assert marks(tmp_path, 2) == [f"{r} 2 {r} 2 ok" for r in range(2)]
    assert f"rendezvous at 127.0.0.1:{port + 1}, served by this rank" in outs[0], outs[0][-2000:]


def test_a_rendezvous_port_that_cannot_be_bound_is_named_with_its_source_and_the_fix(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        procs = start([dict(torchrun_env(0, 2, port), HOROLITE_RENDEZVOUS_PORT=str(port))],
                      tmp_path)
        (out,) = finish(procs, timeout=60)
    assert procs[0].returncode != 0
    assert (f"rank 0 cannot serve the rendezvous on 127.0.0.1 at port {port}: Address already "
            "in use (from HOROLITE_RENDEZVOUS_PORT") in out, out[-3000:]
    assert "choose another free port for HOROLITE_RENDEZVOUS_PORT" in out, out[-3000:]


def test_a_rank_claimed_twice_is_named_with_both_hosts_on_every_rank(tmp_path):
    port = free_port()
    envs = [dict(torchrun_env(r, 3, port, local=False), HOROLITE_GLOO_TIMEOUT_SECONDS="60",
                 HOROLITE_HOSTNAME=f"node{i}") for i, r in enumerate((0, 1, 1))]
    procs = start(envs[:2], tmp_path)
    time.sleep(0.5)  # (the first claim of rank 1 is node1's)
    procs += start(envs[2:], tmp_path)
    outs = finish(procs, timeout=90)
    assert all(p.returncode != 0 for p in procs), outs
    for out in outs:
        assert re.search(r"rank 1 of 3 was claimed by two processes: first by host node1 "
                         r"\(127\.0\.0\.1:\d+\), then by host node2 \(127\.0\.0\.1:\d+\)",
                         out), out[-3000:]
        assert "Give each node its own --node-rank" in out, out[-3000:]


def test_ranks_that_disagree_on_the_job_size_are_named(tmp_path):
    port = free_port()
    envs = [dict(torchrun_env(r, n, port, local=False), HOROLITE_GLOO_TIMEOUT_SECONDS="3")
            for r, n in ((0, 2), (1, 3))]
    procs = start(envs, tmp_path)
    outs = finish(procs, timeout=90)
    assert all(p.returncode != 0 for p in procs), outs
    assert ("rank 0 (host vm) was started as one of 2 ranks, but rank 1 (host vm) as one of 3"
            .replace("vm", socket.gethostname())) in outs[0], outs[0][-3000:]
    assert "lacks 1 of 3: rank 2" in outs[1], outs[1][-3000:]


def test_a_squatted_slurm_port_costs_a_moment_not_the_job(tmp_path):
    from horolite.world.identity import slurm_port
    slurm = dict(SLURM_NTASKS="2", SLURM_TASKS_PER_NODE="2", SLURM_JOB_NODELIST="localhost",
                 SLURM_JOB_ID=str(os.getpid()), SLURM_STEP_ID="0")
    port = slurm_port(slurm)
    # The squatter accepts and never speaks (another job's or user's server, say).
    with socket.create_server(("127.0.0.1", port)):
        procs = start([clean_env(SLURM_PROCID=str(r), SLURM_LOCALID=str(r), **slurm)
                       for r in range(2)], tmp_path)
        outs = finish(procs)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outs)[-4000:]
    assert marks(tmp_path, 2) == [f"{r} 2 {r} 2 ok" for r in range(2)]
    assert f"rendezvous localhost:{port}" not in outs[0], outs[0][-2000:]


def test_pytorchjob_one_rank_per_pod(tmp_path):
    # PyTorchJob gives each pod RANK, WORLD_SIZE, MASTER_ADDR/PORT and no LOCAL_*: one rank
    # per pod, each its own host as far as it knows.
    port = free_port()
    procs = start([torchrun_env(r, 3, port, local=False) for r in range(3)], tmp_path)
    outs = finish(procs)
    assert [p.returncode for p in procs] == [0] * 3, "\n".join(outs)[-4000:]
    assert [m.split()[:2] for m in marks(tmp_path, 3)] == [[str(r), "3"] for r in range(3)]


def test_kubeflow_trainer_pet_variables(tmp_path):
    port = free_port()  # 2 nodes x 2 processes, as torchrun inside Trainer v2's pods sees it
    envs = [clean_env(PET_NNODES="2", PET_NPROC_PER_NODE="2", PET_NODE_RANK=str(r // 2),
                      LOCAL_RANK=str(r % 2), PET_MASTER_ADDR="127.0.0.1",
                      PET_MASTER_PORT=str(port)) for r in range(4)]
    procs = start(envs, tmp_path)
    outs = finish(procs)
    assert [p.returncode for p in procs] == [0] * 4, "\n".join(outs)[-4000:]
    assert [m.split()[:2] for m in marks(tmp_path, 4)] == [[str(r), "4"] for r in range(4)]


def test_tf_config(tmp_path):
    base = free_port()
    cluster = {"chief": [f"127.0.0.1:{base}"], "worker": [f"127.0.0.1:{base + 7}"]}
    envs = [clean_env(TF_CONFIG=json.dumps({"cluster": cluster, "task": task}))
            for task in ({"type": "chief", "index": 0}, {"type": "worker", "index": 0})]
    procs = start(envs, tmp_path)
    outs = finish(procs)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outs)[-4000:]
    assert [m.split()[:2] for m in marks(tmp_path, 2)] == [["0", "2"], ["1", "2"]]


def indexed_job_env(index):
    """The environment docs/clusters.md's Indexed Job gives pod `index` (its manifest read
    from the page): the completion index through the downward API, the key from its Secret."""
    import yaml
    text = open(os.path.join(ROOT, "docs", "clusters.md")).read()
    section = text[text.index("## Kubernetes without MPI"):]
    manifest = section[section.index("```yaml") + 7:section.index("```", section.index("```yaml") + 7)]
    job = [d for d in yaml.safe_load_all(manifest) if d["kind"] == "Job"][0]
    assert job["spec"]["completionMode"] == "Indexed"
    env = {}
    for var in job["spec"]["template"]["spec"]["containers"][0]["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "fieldRef" in var["valueFrom"]:
            path = var["valueFrom"]["fieldRef"]["fieldPath"]
            assert path == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
            env[var["name"]] = str(index)
        else:
            assert "secretKeyRef" in var["valueFrom"]
            env[var["name"]] = KEY
    return env, job["spec"]["completions"]


def test_kubernetes_indexed_job_as_the_docs_write_it(tmp_path):
    # Here the pods are processes of this machine: pod 0's DNS name under the headless
    # Service (MASTER_ADDR) is this host's loopback, and the port a free one.
    port = free_port()
    envs = []
    for index in range(indexed_job_env(0)[1]):
        env, _ = indexed_job_env(index)
        assert env["MASTER_ADDR"] == "train-0.train"
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        envs.append(clean_env(**env))
    n = len(envs)
    procs = start(envs, tmp_path)
    outs = finish(procs)
    assert [p.returncode for p in procs] == [0] * n, "\n".join(outs)[-4000:]
    assert [m.split()[:2] for m in marks(tmp_path, n)] == [[str(r), str(n)] for r in range(n)]


def test_a_rank_that_never_arrives_is_named_within_the_timeout(tmp_path):
    port = free_port()
    envs = [dict(torchrun_env(r, 3, port), HOROLITE_GLOO_TIMEOUT_SECONDS="4") for r in (0, 1)]
    begun = time.monotonic()
    procs = start(envs, tmp_path)
    outs = finish(procs, timeout=90)
    took = time.monotonic() - begun
    assert all(p.returncode != 0 for p in procs)
    for out in outs:
        assert "rank 2" in out and "4 s" in out, out[-3000:]
    assert took < 60, took  # 4 s after each rank's start (its imports are the rest)


def test_strangers_at_the_rendezvous_do_not_stop_the_job(tmp_path):
    from horolite.world.rendezvous import RendezvousClient, RendezvousError, RendezvousServer
    key = bytes.fromhex(KEY)
    with RendezvousServer(key, "127.0.0.1", 0) as server:
        silent = socket.create_connection(("127.0.0.1", server.port))
        garbage = socket.create_connection(("127.0.0.1", server.port))
        garbage.sendall(os.urandom(4096))
        with pytest.raises(RendezvousError):
            RendezvousClient("127.0.0.1", server.port, os.urandom(32), timeout=5)
        envs = [clean_env(HOROLITE_RANK=str(r), HOROLITE_SIZE="3", HOROLITE_LOCAL_RANK=str(r),
                          HOROLITE_LOCAL_SIZE="3", HOROLITE_RENDEZVOUS_ADDR="127.0.0.1",
                          HOROLITE_RENDEZVOUS_PORT=str(server.port)) for r in range(3)]
        procs = start(envs, tmp_path)
        outs = finish(procs)
        silent.close()
        garbage.close()
    assert [p.returncode for p in procs] == [0] * 3, "\n".join(outs)[-4000:]
    assert marks(tmp_path, 3) == [f"{r} 3 {r} 3 ok" for r in range(3)]


def test_a_wrong_key_fails_init_with_the_reason(tmp_path):
    port = free_port()
    envs = [torchrun_env(0, 2, port), dict(torchrun_env(1, 2, port),
                                           HOROLITE_JOB_KEY=os.urandom(32).hex())]
    for env in envs:
        env["HOROLITE_GLOO_TIMEOUT_SECONDS"] = "5"
    procs = start(envs, tmp_path)
    outs = finish(procs, timeout=90)
    assert all(p.returncode != 0 for p in procs)
    assert "key" in outs[1], outs[1][-3000:]
