"""Where each Ray worker sits in the job: its rank, its host's ranks, and what it is told.

Ray gives workers in the order they were placed; horolite numbers them so that the
workers of one machine hold consecutive ranks (as mpirun's by-slot mapping does), since
that is how the ranks themselves group hosts (by machine name) for shared memory and the
hierarchical paths. Messages name each rank's Ray node, so a failure says where it was.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Dict, List, Mapping, Sequence, Tuple

from .gpus import shared_gpus, user_picks_device

from horolite.core.settings import PREFIXES, WORLD
from horolite.launcher.gloo import rank_env, slots_for

__all__ = ["Placed", "NodeInfo", "place", "forwarded_settings", "nic_settings"]

# What a rank learns who it is from is the layout's (settings.WORLD, less the interface and
# the timeout, which are settings); the elastic driver names its workers. Everything else
# of these prefixes is a setting the driver's environment passes on to every worker.
_IDENTITY = (set(WORLD) - {"GLOO_IFACE", "GLOO_TIMEOUT_SECONDS"}) | {"ELASTIC_WORKER",
                                                                     "ELASTIC_JOIN"}


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    """What a worker says about where it runs."""
    node_id: str
    node_ip: str
    machine: str  # socket.gethostname(): the name the ranks group hosts by
    pid: int
    gpu_ids: Tuple[str, ...] = ()  # what Ray gave this worker

    def label(self) -> str:
        return f"{self.node_ip} node {self.node_id[:8]}"


@dataclasses.dataclass(frozen=True)
class Placed:
    worker: int  # index in the order Ray gave the workers
    rank: int
    node: NodeInfo
    env: Dict[str, str] = dataclasses.field(repr=False)  # (it holds the job's key)


def place(nodes: Sequence[NodeInfo], rendezvous: Tuple[str, int], key: bytes,
          timeout: float, keep_order: bool = False) -> List[Placed]:
    """Each worker's rank and environment, in rank order. `keep_order`: worker i is rank
    i (Ray Train numbers its workers itself); else each machine's ranks are consecutive.
    Workers with GPUs see all of their machine's (gpus.py)."""
    machines = list(dict.fromkeys(n.machine for n in nodes))
    order = list(range(len(nodes))) if keep_order else \
        sorted(range(len(nodes)), key=lambda i: (machines.index(nodes[i].machine), i))
    slots = slots_for([nodes[i].machine for i in order])
    gpus = {m: [nodes[i].gpu_ids for i in order if nodes[i].machine == m] for m in machines}
    pick = not user_picks_device()
    placed = []
    for slot, i in zip(slots, order):
        env = rank_env(slot, len(nodes), rendezvous[0], rendezvous[1], timeout, key)
        env["HOROLITE_HOSTNAME"] = env["HOROVOD_HOSTNAME"] = nodes[i].label()
        env.update(shared_gpus(nodes[i].gpu_ids, gpus[nodes[i].machine], slot.local_rank, pick))
        placed.append(Placed(i, slot.rank, nodes[i], env))
    return placed


def forwarded_settings(environ: Mapping[str, str] = os.environ) -> Dict[str, str]:
    """The driver's HOROLITE_*/HOROVOD_* settings (not its identity, if it has one)."""
    return {name: value for name, value in environ.items()
            if name.startswith(PREFIXES)
            and name.split("_", 1)[1] not in _IDENTITY}


def nic_settings(nics) -> Dict[str, str]:
    """Horovod's ``nics`` (the interfaces its ranks use) as horolite's settings: its TCP
    connections on exactly those (HOROLITE_TCP_IFACE, NCCL_SOCKET_IFNAME's "=" form),
    and Horovod's GLOO_IFACE name, one of them, for code that reads it."""
    if not nics:
        return {}
    if isinstance(nics, str):
        nics = [nics]
    names = sorted(str(n) for n in nics)
    return {"HOROLITE_TCP_IFACE": "=" + ",".join(names), "HOROLITE_GLOO_IFACE": names[0],
            "HOROVOD_GLOO_IFACE": names[0]}
