"""The reference for the host layout a rank-side test runs in, from known inputs only:
the machine's name, or the pretend hosts of HOROLITE_TEST_HOST_IDENTITY ("2+1+1": job
ranks 0-1 on one host, 2 and 3 on one each), never from horolite's own answer."""
import os

from horolite.core.mpi_library import MPI  # the job world's: mpi4py's under mpirun

VARIABLE = "HOROLITE_TEST_HOST_IDENTITY"


def layout():
    """The host of every job rank, in rank order (a list of labels)."""
    raw = os.environ.get(VARIABLE, "")
    comm = MPI.COMM_WORLD
    if not raw:
        return comm.allgather(MPI.Get_processor_name())
    labels = []
    for host, count in enumerate(raw.split("+")):
        labels += [f"pretend{host}"] * int(count)
    assert len(labels) == comm.Get_size(), (raw, comm.Get_size())
    return labels


def expected_topology(rank):
    """What hvd.local_rank()... must say on `rank`, computed from layout()."""
    hosts = layout()
    order = list(dict.fromkeys(hosts))
    mine = [r for r in range(len(hosts)) if hosts[r] == hosts[rank]]
    local_rank = mine.index(rank)
    # the cross communicator: the ranks with the same local rank, one per host that has one
    cross = [r for r in range(len(hosts))
             if [q for q in range(len(hosts)) if hosts[q] == hosts[r]].index(r) == local_rank]
    counts = [hosts.count(h) for h in order]
    return {"local_rank": local_rank, "local_size": len(mine), "cross_rank": cross.index(rank),
            "cross_size": len(cross), "is_homogeneous": len(set(counts)) == 1, "hosts": counts}


def hierarchical_applies():
    """The hierarchical collectives serve: hosts of equal size > 1, more than one host,
    ranks in blocks (pretend hosts always are)."""
    counts = expected_topology(0)["hosts"]
    return len(counts) > 1 and len(set(counts)) == 1 and counts[0] > 1
