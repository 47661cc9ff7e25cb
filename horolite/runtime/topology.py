"""Where this rank is: rank/size of the job, of its host and across hosts."""
from __future__ import annotations

from ..core.mpi_library import MPI

from ..core.hosts import host_name, kept_slot, split_by_host

__all__ = ["Topology"]


class Topology:
    """rank/size of the job, of this host and across hosts."""

    def __init__(self, comm: MPI.Comm):
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        local = split_by_host(comm)  # (HOROLITE_TEST_HOST_IDENTITY: pretend hosts, tests only)
        self.local_rank = local.Get_rank()
        self.local_size = local.Get_size()
        cross = comm.Split(color=self.local_rank, key=self.rank)
        slot = kept_slot()
        if slot is not None:  # (an elastic worker's slot for life: a host's empty slot
            self.local_rank = slot  # leaves the others' local ranks as they were)
        self.cross_rank = cross.Get_rank()
        self.cross_size = cross.Get_size()
        local_sizes = comm.allgather(self.local_size)
        self.is_homogeneous = len(set(local_sizes)) == 1
        # each host's k ranks count 1/k each: the number of hosts, the same on every rank
        self.hosts = round(sum(1.0 / n for n in local_sizes))
        self.hostname = host_name()
        local.Free()
        cross.Free()
