"""Rank side: rank, local_rank, cross_rank... agree with the host layout of the job."""
import os
import socket

import numpy as np

import horolite as hvd
from horolite.core.config import env_value

hvd.init()


def layout():
    """[(host, slots)] from HOROLITE_TEST_LAYOUT ("hl-a:1,hl-b:2"), ranks filling hosts in order."""
    return [(h, int(n)) for h, n in (e.split(":") for e in os.environ["HOROLITE_TEST_LAYOUT"].split(","))]


def test_topology_matches_layout():
    hosts = layout()
    owners = [h for h, n in hosts for _ in range(n)]
    assert hvd.size() == len(owners)
    me = hvd.rank()
    assert socket.gethostname() == owners[me]
    same_host = [r for r, h in enumerate(owners) if h == owners[me]]
    assert hvd.local_size() == len(same_host)
    assert hvd.local_rank() == same_host.index(me)
    with_my_local_rank = [h for h, n in hosts if n > hvd.local_rank()]
    assert hvd.cross_size() == len(with_my_local_rank)
    assert hvd.cross_rank() == with_my_local_rank.index(owners[me])
    assert hvd.is_homogeneous() == (len({n for _, n in hosts}) == 1)


def test_a_collective_spans_every_host():
    sums = hvd.allreduce(np.full(3, hvd.rank(), dtype=np.int64), op=hvd.Sum, name="ranks")
    assert sums.tolist() == [sum(range(hvd.size()))] * 3


def test_hierarchical_path_where_the_layout_allows():
    hosts = layout()
    per_host = {n for _, n in hosts}
    allowed = len(hosts) > 1 and len(per_host) == 1 and per_host.pop() > 1
    from horolite.api.basics import runtime
    transport = runtime().transport
    # allreduce: on unless switched off; allgather: off unless asked for.
    for kind, default in (("ALLREDUCE", "1"), ("ALLGATHER", "0")):
        asked = (env_value(f"HIERARCHICAL_{kind}") or default) == "1"
        used = getattr(transport, f"hierarchical_{kind.lower()}") is not None
        assert used == (allowed and asked), kind
