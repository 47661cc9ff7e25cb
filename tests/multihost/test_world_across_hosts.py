"""Jobs without MPI started as schedulers start them, across simulated hosts: a
PyTorchJob's pods (one rank per host, the key from a file) and torchrun's processes (two
per host, its agent's store holding MASTER_PORT on the first host). Every rank checks its
collectives against NumPy (world_rank/reduce_and_mark.py)."""
import os
import subprocess
import sys

from jobs import ROOT

RANK_SCRIPT = os.path.join(ROOT, "tests", "world_rank", "reduce_and_mark.py")
LEAKS = ("PMI_", "OMPI_", "PMIX_", "HYDRA_", "MPI_LOCAL", "SLURM_", "HOROLITE_", "HOROVOD_",
         "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "PET_", "TF_CONFIG", "TORCHELASTIC_")


def ranks(bed, placed, outdir, **common):
    """Each (host, variables) of `placed` as one rank's process on that host."""
    procs = []
    for host, own in placed:
        env = {k: v for k, v in os.environ.items() if not k.startswith(LEAKS)}
        env.update(PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="3", HOROLITE_LOG_LEVEL="INFO",
                   **common, **own)
        procs.append(bed.popen(host, [sys.executable, RANK_SCRIPT, str(outdir)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0] + "\n(killed: timed out)")
    return procs, outs


def test_pytorchjob_pods_and_torchrun_processes_across_hosts(bed, tmp_path):
    key = tmp_path / "job.key"
    key.write_text(os.urandom(32).hex())
    key.chmod(0o600)
    master = bed.host("hl-a").address
    common = dict(HOROLITE_JOB_KEY_FILE=str(key), MASTER_ADDR=master)

    pods = tmp_path / "pytorchjob"
    pods.mkdir()
    placed = [(h, {"RANK": str(r)}) for r, h in enumerate(("hl-a", "hl-b", "hl-c"))]
    procs, outs = ranks(bed, placed, pods, WORLD_SIZE="3", MASTER_PORT="29500", **common)
    assert [p.returncode for p in procs] == [0] * 3, "\n".join(outs)[-4000:]
    assert [(pods / f"rank.{r}").read_text() for r in range(3)] == [f"{r} 3 0 1 ok"
                                                                    for r in range(3)]

    torchrun = tmp_path / "torchrun"
    torchrun.mkdir()
    agent_store = bed.popen("hl-a", [sys.executable, "-c", "import socket, time; s = socket."
                                     "create_server(('0.0.0.0', 29600)); print(1, flush=True); "
                                     "time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    try:
        assert agent_store.stdout.readline().strip() == "1"
        placed = [(h, {"RANK": str(r), "LOCAL_RANK": str(r % 2)})
                  for r, h in enumerate(("hl-a", "hl-a", "hl-b", "hl-b"))]
        procs, outs = ranks(bed, placed, torchrun, WORLD_SIZE="4", LOCAL_WORLD_SIZE="2",
                            MASTER_PORT="29600", TORCHELASTIC_RUN_ID="bed", **common)
    finally:
        agent_store.kill()
        agent_store.wait()
    assert [p.returncode for p in procs] == [0] * 4, "\n".join(outs)[-4000:]
    assert [(torchrun / f"rank.{r}").read_text() for r in range(4)] == [
        f"{r} 4 {r % 2} 2 ok" for r in range(4)]
    assert f"rendezvous at {master}:29601, served by this rank" in outs[0], outs[0][-2000:]
