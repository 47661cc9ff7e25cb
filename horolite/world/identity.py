"""Who this rank is, read from the environment, for jobs started without MPI.

Without mpirun nobody hands a process its rank: a launcher (horolite's own, or
Horovod's Gloo one) or a scheduler (torchrun, a Kubeflow job, Slurm, TF_CONFIG) left
it in variables, each in its own dialect. The first COMPLETE set wins, in the order
of ``_SOURCES``: an explicit launcher's names before any scheduler's, so a launcher
run inside a Slurm allocation or a pod is believed. A set that is complete but wrong
(a word for a number, rank 4 of 4) is an error naming the variables, never a guess.

A process an MPI launcher started is no identity source: mpirun inside an allocation
leaves Slurm's names behind (the ``srun`` that started its daemons), and they describe
the daemons, not the ranks. Only the launchers' explicit sets are read then.

The job's secret (job_key.py) comes from HOROLITE_JOB_KEY or a file named by
HOROLITE_JOB_KEY_FILE, never from the command line, which every user of the host can
read in ``ps``.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass
from typing import Callable, List, Mapping, Optional, Sequence, Tuple

from horolite.failure.launch_check import LAUNCHERS
from horolite.world import rendezvous_ports
from horolite.world.job_key import MIN_KEY_BYTES, job_key
from horolite.world.slurm_lists import hosts, tasks_per_node

__all__ = ["Identity", "from_environ", "under_mpi_launcher", "log_once", "job_key",
           "slurm_port", "MIN_KEY_BYTES"]

_log = logging.getLogger("horolite.world.identity")

SLURM_PORT_BASE, SLURM_PORT_SPAN = rendezvous_ports.SLURM_BASE, rendezvous_ports.SLURM_SPAN


@dataclass(frozen=True)
class Identity:
    rank: int
    size: int
    local_rank: int
    local_size: int
    rendezvous_addr: str
    rendezvous_port: int
    source: str
    serve: bool  # this rank (rank 0 of a scheduler-started job) serves the rendezvous
    host_label: Optional[str]  # the launcher's name for this rank's host, if it gave one
    # Every port the rendezvous may be on, in order (rendezvous_ports.py; rendezvous_port
    # is the first); empty: rendezvous_port only.
    ports: Tuple[int, ...] = ()
    port_from: str = ""  # where that port came from, for an error that names it

    def candidates(self) -> Tuple[int, ...]:
        return self.ports or (self.rendezvous_port,)


# --- MPI launchers ---------------------------------------------------------------------

# launch_check's launchers other than srun itself (PMI_*, OMPI_COMM_WORLD_*), and what
# only an MPI launcher sets: Hydra's local counts, MVAPICH's mpirun_rsh, PMIx.
_MPI_ONLY = tuple(v for size, rank, _ in LAUNCHERS for v in (size, rank)
                  if not v.startswith(("SLURM_", "PMI_"))) + (
    "MPI_LOCALNRANKS", "MPI_LOCALRANKID", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK")


def under_mpi_launcher(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether an MPI launcher (mpirun, mpiexec, mpirun_rsh) started this process.
    srun's own PMI wiring (PMI_RANK/PMIX_RANK equal to SLURM_PROCID, as MpiDefault=pmix
    sites give every task) is srun's, not an MPI launcher's."""
    if any(_given(environ, v) for v in _MPI_ONLY):
        return True
    procid = environ.get("SLURM_PROCID", "").strip()
    ntasks = (environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS") or "").strip()
    for rank_var, size_var in (("PMI_RANK", "PMI_SIZE"), ("PMIX_RANK", None)):
        if not _given(environ, rank_var):
            continue
        srun_own = procid and environ[rank_var].strip() == procid and (
            size_var is None or not _given(environ, size_var)
            or environ[size_var].strip() == ntasks)
        if not srun_own:
            return True
    if _given(environ, "PMI_SIZE") and not _given(environ, "PMI_RANK"):
        return True
    return False


# --- helpers -----------------------------------------------------------------------------

def _given(environ: Mapping[str, str], name: str) -> bool:
    return bool(environ.get(name, "").strip())


def _complete(environ: Mapping[str, str], names: Sequence[str]) -> bool:
    return all(_given(environ, n) for n in names)


def _int(environ: Mapping[str, str], name: str) -> int:
    text = environ[name].strip()
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not an integer") from None


def _check(rank: Tuple[str, int], size: Tuple[str, int], what: str = "rank") -> None:
    """`rank` (a described value) must lie in [0, size) and size be at least 1."""
    (rname, r), (sname, s) = rank, size
    if s < 1:
        raise ValueError(f"{sname}={s} must be at least 1")
    if not 0 <= r < s:
        raise ValueError(f"{rname}={r} is not a valid {what} for {sname}={s} "
                         f"(it must be 0 to {s - 1})")


def _port(name: str, value: int) -> int:
    if not 0 < value < 65536:
        raise ValueError(f"{name}={value} is not a TCP port (1 to 65535)")
    return value


def _host_label(environ: Mapping[str, str]) -> Optional[str]:
    for name in ("HOROLITE_HOSTNAME", "HOROVOD_HOSTNAME"):
        if _given(environ, name):
            return environ[name].strip()
    return None


def _identity(environ, rank, size, local_rank, local_size, addr, port, source,
              scheduler) -> Identity:
    """`port`: a port, or for a scheduler (name, candidate ports), which the override
    HOROLITE_RENDEZVOUS_PORT replaces."""
    _check(local_rank, local_size, "local rank")
    _check(rank, size)
    if local_size[1] > size[1]:
        raise ValueError(f"{local_size[0]}={local_size[1]} is more than {size[0]}={size[1]}")
    ports, port_from = (), ""
    if scheduler:
        port_from, ports = _override_port(environ) or port
        port = ports[0]
    return Identity(rank[1], size[1], local_rank[1], local_size[1], addr, port, source,
                    serve=scheduler and rank[1] == 0, host_label=_host_label(environ),
                    ports=tuple(ports), port_from=port_from)


def _override_port(environ: Mapping[str, str]) -> Optional[Tuple[str, Tuple[int, ...]]]:
    name = "HOROLITE_RENDEZVOUS_PORT"
    return (name, (_port(name, _int(environ, name)),)) if _given(environ, name) else None


# --- the sources, in order -----------------------------------------------------------------

def _launcher_set(names: Sequence[str], source: str):
    def read(environ: Mapping[str, str]) -> Optional[Identity]:
        if not _complete(environ, names):
            return None
        r, s, lr, ls, addr, port = names
        return _identity(environ, (r, _int(environ, r)), (s, _int(environ, s)),
                         (lr, _int(environ, lr)), (ls, _int(environ, ls)),
                         environ[addr].strip(), _port(port, _int(environ, port)), source, False)
    return read


_horolite = _launcher_set((
    "HOROLITE_RANK", "HOROLITE_SIZE", "HOROLITE_LOCAL_RANK", "HOROLITE_LOCAL_SIZE",
    "HOROLITE_RENDEZVOUS_ADDR", "HOROLITE_RENDEZVOUS_PORT"), "HOROLITE_*")
_horovod = _launcher_set((
    "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
    "HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT"), "Horovod Gloo (HOROVOD_*)")


def _torchrun(environ: Mapping[str, str]) -> Optional[Identity]:
    if not _complete(environ, ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    local = [n for n in ("LOCAL_RANK", "LOCAL_WORLD_SIZE") if _given(environ, n)]
    if len(local) == 1:
        raise ValueError(f"{local[0]}={environ[local[0]].strip()} is set without "
                         f"{({'LOCAL_RANK', 'LOCAL_WORLD_SIZE'} - set(local)).pop()}")
    # Without LOCAL_*: a PyTorchJob pod holds one process.
    lr = ("LOCAL_RANK", _int(environ, "LOCAL_RANK")) if local else ("LOCAL_RANK", 0)
    ls = ("LOCAL_WORLD_SIZE", _int(environ, "LOCAL_WORLD_SIZE")) if local else ("LOCAL_WORLD_SIZE", 1)
    master = _port("MASTER_PORT", _int(environ, "MASTER_PORT"))
    if rendezvous_ports.under_torchrun(environ):  # (its agent's store holds MASTER_PORT)
        port = ("MASTER_PORT+1 (torchrun's agent serves MASTER_PORT)",
                rendezvous_ports.after(master))
    else:  # (a PyTorchJob pod's one process: nobody else serves MASTER_PORT)
        _one_process_per_pod(environ, "WORLD_SIZE", "RANK")
        port = ("MASTER_PORT", (master,))
    return _identity(environ, ("RANK", _int(environ, "RANK")),
                     ("WORLD_SIZE", _int(environ, "WORLD_SIZE")), lr, ls,
                     environ["MASTER_ADDR"].strip(), port,
                     "torchrun (RANK/WORLD_SIZE/MASTER_ADDR)", True)


def _one_process_per_pod(environ: Mapping[str, str], size: str, rank: str) -> None:
    """Kubeflow counts PET_NPROC_PER_NODE processes a pod, but only torchrun starts them:
    a pod's one process, started as plain python, cannot be them all."""
    if not _given(environ, "PET_NPROC_PER_NODE") or rendezvous_ports.under_torchrun(environ):
        return
    text = environ["PET_NPROC_PER_NODE"].strip()
    if text.isdigit() and int(text) <= 1:
        return
    raise ValueError(
        f"PET_NPROC_PER_NODE={text}: Kubeflow counts {text} processes per pod in {size}, "
        f"but this process was started without torchrun, so the pod holds only one ({rank} "
        "is the pod's index). Start the script with torchrun in the container's command "
        "(`torchrun train.py`: it reads PET_* itself), or set nprocPerNode to 1")


def _pet_count(environ: Mapping[str, str], name: str) -> int:
    """torchrun's PET_ counts: an integer, or "n:n" (an elastic range that is not one)."""
    text = environ[name].strip()
    low, _, high = text.partition(":")
    if high and low.strip() == high.strip():
        text = low
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={environ[name].strip()!r} is not an integer (started "
                         f"without torchrun, each rank needs the count itself)") from None


def _kubeflow_trainer(environ: Mapping[str, str]) -> Optional[Identity]:
    names = ("PET_NODE_RANK", "PET_NNODES", "PET_NPROC_PER_NODE", "PET_MASTER_ADDR",
             "PET_MASTER_PORT")
    if not _complete(environ, names):
        return None
    node, nnodes = _int(environ, "PET_NODE_RANK"), _pet_count(environ, "PET_NNODES")
    nproc = _pet_count(environ, "PET_NPROC_PER_NODE")
    if not _given(environ, "LOCAL_RANK"):  # (else: some launcher of the pod's own)
        _one_process_per_pod(environ, "PET_NNODES*PET_NPROC_PER_NODE", "PET_NODE_RANK")
    local = _int(environ, "LOCAL_RANK") if _given(environ, "LOCAL_RANK") else 0
    _check(("PET_NODE_RANK", node), ("PET_NNODES", nnodes), "node rank")
    _check(("LOCAL_RANK", local), ("PET_NPROC_PER_NODE", nproc), "local rank")
    return _identity(environ, ("PET_NODE_RANK*PET_NPROC_PER_NODE+LOCAL_RANK", node * nproc + local),
                     ("PET_NNODES*PET_NPROC_PER_NODE", nnodes * nproc),
                     ("LOCAL_RANK", local), ("PET_NPROC_PER_NODE", nproc),
                     environ["PET_MASTER_ADDR"].strip(),
                     ("PET_MASTER_PORT",
                      (_port("PET_MASTER_PORT", _int(environ, "PET_MASTER_PORT")),)),
                     "Kubeflow Trainer (PET_*)", True)


def _first_of(environ: Mapping[str, str], names: Sequence[str]) -> Optional[str]:
    return next((n for n in names if _given(environ, n)), None)


def _slurm(environ: Mapping[str, str]) -> Optional[Identity]:
    # srun's per-step names first: a step may run on part of the allocation. SLURM_STEP_ID
    # is srun's: a batch script (SLURM_PROCID=0 of the job's N tasks) is no rank.
    size_var = _first_of(environ, ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"))
    nodes_var = _first_of(environ, ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"))
    per_node_var = _first_of(environ, ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
                                       "SLURM_NTASKS_PER_NODE"))
    if not (_complete(environ, ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_ID"))
            and size_var and nodes_var and per_node_var):
        return None
    try:
        first = next(hosts(environ[nodes_var]), None)
        if first is None:
            raise ValueError("no host in it")
    except ValueError as e:
        raise ValueError(f"{nodes_var}={environ[nodes_var].strip()!r}: {e}") from None
    try:
        counts = tasks_per_node(environ[per_node_var])
    except ValueError as e:
        raise ValueError(f"{per_node_var}={environ[per_node_var].strip()!r}: {e}") from None
    if per_node_var == "SLURM_NTASKS_PER_NODE" and len(counts) == 1:
        local_size = counts[0]  # (one count for every node)
    elif _given(environ, "SLURM_NODEID"):
        node = _int(environ, "SLURM_NODEID")
        _check(("SLURM_NODEID", node), (per_node_var + " (nodes)", len(counts)), "node id")
        local_size = counts[node]
    elif len(set(counts)) == 1:
        local_size = counts[0]
    else:
        raise ValueError(f"{per_node_var}={environ[per_node_var].strip()!r} differs between "
                         f"nodes and SLURM_NODEID is not set")
    port = _override_port(environ) or (
        "the Slurm job and step id (SLURM_JOB_ID.SLURM_STEP_ID)", _slurm_ports(environ))
    return _identity(environ, ("SLURM_PROCID", _int(environ, "SLURM_PROCID")),
                     (size_var, _int(environ, size_var)),
                     ("SLURM_LOCALID", _int(environ, "SLURM_LOCALID")),
                     (per_node_var, local_size), first, port, "Slurm (SLURM_PROCID)", True)


def slurm_port(environ: Mapping[str, str] = os.environ) -> int:
    """The first rendezvous port every task of this Slurm step computes alike
    (20000-29999), so that two steps or jobs sharing a node rarely meet on one port."""
    return _slurm_ports(environ)[0]


def _slurm_ports(environ: Mapping[str, str]) -> Tuple[int, ...]:
    job_var = _first_of(environ, ("SLURM_JOB_ID", "SLURM_JOBID"))
    if job_var is None:
        raise ValueError("SLURM_JOB_ID is not set: set HOROLITE_RENDEZVOUS_PORT")
    return rendezvous_ports.slurm_ports(environ[job_var].strip(),
                                        environ.get("SLURM_STEP_ID", "").strip())


def _tf_config(environ: Mapping[str, str]) -> Optional[Identity]:
    if not _given(environ, "TF_CONFIG"):
        return None
    try:
        config = json.loads(environ["TF_CONFIG"])
    except ValueError as e:
        raise ValueError(f"TF_CONFIG is not valid JSON ({e})") from None
    cluster = config.get("cluster") if isinstance(config, dict) else None
    task = config.get("task") if isinstance(config, dict) else None
    if not cluster or not task:
        return None
    try:
        chief, workers = list(cluster.get("chief", [])), list(cluster.get("worker", []))
        kind, index = task["type"], int(task["index"])
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"TF_CONFIG's cluster/task is malformed ({type(e).__name__}: {e}): "
                         f"want cluster {{'chief': [...], 'worker': [...]}} and task "
                         f"{{'type', 'index'}}") from None
    if kind not in ("chief", "worker"):
        raise ValueError(f"TF_CONFIG task type {kind!r} is not a horolite rank "
                         f"(only 'chief' and 'worker' are)")
    members = chief if kind == "chief" else workers
    _check(("TF_CONFIG task index", index), (f"len(TF_CONFIG cluster[{kind!r}])", len(members)),
           "index")
    addrs = chief + workers
    host, first_port = _split_host_port(str(addrs[0]))
    where = f"TF_CONFIG's first address {addrs[0]!r} + 1"
    port = (where, rendezvous_ports.after(_port(where, first_port + 1) - 1))
    if _given(environ, "HOROLITE_LOCAL_RANK") and _given(environ, "HOROLITE_LOCAL_SIZE"):
        lr = ("HOROLITE_LOCAL_RANK", _int(environ, "HOROLITE_LOCAL_RANK"))
        ls = ("HOROLITE_LOCAL_SIZE", _int(environ, "HOROLITE_LOCAL_SIZE"))
    else:
        lr, ls = ("local rank", 0), ("local size", 1)
    rank = index if kind == "chief" else len(chief) + index
    return _identity(environ, ("TF_CONFIG task", rank), ("TF_CONFIG cluster size", len(addrs)),
                     lr, ls, host, port, "TF_CONFIG", True)


def _split_host_port(addr: str) -> Tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.strip().isdigit():
        raise ValueError(f"TF_CONFIG address {addr!r} is not host:port")
    return host.strip("[]"), int(port)


_SOURCES: List[Tuple[Callable[[Mapping[str, str]], Optional[Identity]], bool]] = [
    (_horolite, False), (_horovod, False),  # (read, ignored under an MPI launcher)
    (_torchrun, True), (_kubeflow_trainer, True), (_slurm, True), (_tf_config, True),
]


def from_environ(environ: Mapping[str, str] = os.environ) -> Optional[Identity]:
    """This rank's identity from the first complete set of variables, or None when there
    is none. ValueError, naming the variables, when that set is malformed."""
    mpi = under_mpi_launcher(environ)
    for read, scheduler in _SOURCES:
        if scheduler and mpi:
            continue
        found = read(environ)
        if found is not None:
            return found
    return None


_logged = set()
_logged_lock = threading.Lock()


def log_once(identity: Identity, logger: logging.Logger = _log) -> None:
    """Say once per process (per identity) where this rank's identity came from."""
    with _logged_lock:
        if identity in _logged:
            return
        _logged.add(identity)
    logger.info("rank %d of %d (local %d of %d): identity from %s; rendezvous at %s:%d%s",
                identity.rank, identity.size, identity.local_rank, identity.local_size,
                identity.source, identity.rendezvous_addr, identity.rendezvous_port,
                ", served by this rank" if identity.serve else "")
