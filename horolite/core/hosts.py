"""Which ranks share a host: MPI's shared-memory split, or the test harness's pretend hosts.

Everything that depends on the host layout (topology, the shared-memory path, the
hierarchical collectives) asks here, so one test-only variable can make the ranks
of one machine look like several hosts and run the multi-host paths on one machine:

    HOROLITE_TEST_HOST_IDENTITY=2+1+1   # job ranks 0-1 on one host, 2 and 3 on one each
    HOROLITE_TEST_HOST_IDENTITY=each    # every rank on a host of its own

It is for this repository's tests only (the HOROLITE_TEST_ prefix), never a user
setting: ranks on pretend hosts still share the machine's memory and cores.
"""
from __future__ import annotations

import os
from typing import List, Optional

from .mpi_library import MPI

__all__ = ["VARIABLE", "pretend_layout", "pretend_host", "split_by_host", "host_name"]

VARIABLE = "HOROLITE_TEST_HOST_IDENTITY"


def pretend_layout() -> Optional[List[int]]:
    """The pretend hosts' sizes in job-rank order, or None when the variable is unset."""
    raw = os.environ.get(VARIABLE, "").strip()
    if not raw:
        return None
    if raw == "each":  # (every rank a host of its own, whatever the size: elastic jobs)
        return [1] * MPI.COMM_WORLD.Get_size()
    try:
        sizes = [int(part) for part in raw.split("+")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ValueError(f"{VARIABLE}={raw!r} must be host sizes joined by '+', e.g. 2+1+1")
    world = MPI.COMM_WORLD.Get_size()
    if sum(sizes) != world:
        raise ValueError(f"{VARIABLE}={raw!r} places {sum(sizes)} ranks, but the job has {world}")
    return sizes


def pretend_host(world_rank: int, sizes: List[int]) -> int:
    """Index of the pretend host that job rank `world_rank` is on."""
    end = 0
    for host, size in enumerate(sizes):
        end += size
        if world_rank < end:
            return host
    raise ValueError(f"job rank {world_rank} is outside {VARIABLE}'s {sizes}")


def host_name() -> str:
    """This rank's host as messages name it ("node1", or "node1~host2" for a pretend host)."""
    name = MPI.Get_processor_name()
    sizes = pretend_layout()
    if sizes is None:
        return name
    return f"{name}~host{pretend_host(MPI.COMM_WORLD.Get_rank(), sizes)}"


def split_by_host(comm: MPI.Comm) -> MPI.Comm:
    """A communicator of the ranks of `comm` on this rank's host, ordered as in `comm`.

    Collective over `comm`; the caller frees it."""
    key = comm.Get_rank()
    if pretend_layout() is None:
        return comm.Split_type(MPI.COMM_TYPE_SHARED, key=key)
    # The real host and the pretend one: ranks share a host only if both agree.
    names = comm.allgather(host_name())
    color = sorted(set(names)).index(names[comm.Get_rank()])
    return comm.Split(color=color, key=key)


def kept_slot() -> Optional[int]:
    """For a worker of an elastic job without MPI (horolite-run --gloo --min-np): the
    slot on its host it keeps for its life (its local rank in the launcher's plan), else
    None: runtime/topology.py makes it this worker's local rank (a new worker in a freed
    slot gets that one, and a survivor keeps its own, with the GPU it pinned by it). The
    host's communicator stays in rank order, as the transports between hosts expect."""
    try:
        return int(os.environ["HOROLITE_ELASTIC_SLOT"])  # (world/generations.py sets it)
    except (KeyError, ValueError):
        return None
