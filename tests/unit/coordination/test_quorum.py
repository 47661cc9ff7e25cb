"""Rank 0's quorum decisions (pure logic): who counts, who was present, and
the pieces of a fused plan and of the response cache that must leave them alone."""
import pytest

from horolite.errors import InvalidCollectiveError
from horolite.execution.fusion import plan_spans
from horolite.core.messages import Kind, Request, Response
from horolite.coordination.negotiation import Coordinator
from horolite.core.ops import Average, Max, Sum
from horolite.coordination.quorum import check_quorum
from horolite.coordination.response_cache import ResponseCache


def req(name, quorum=2, shape=(3,), op=Average):
    return Request(name, Kind.ALLREDUCE, "float32", shape, op=int(op), quorum=quorum)


def test_decided_once_k_ranks_arrived_first_arrivals_count():
    c = Coordinator(4)
    c.add(3, [req("g")], now=0.0)
    assert c.responses() == []
    c.add(1, [req("g")], now=1.0)
    c.add(0, [req("g")], now=1.0)
    (resp,) = c.responses()
    # arrival order decides: rank 3, then rank 1 (added before rank 0)
    assert resp.contributors == (1, 3) and resp.present == (0, 1, 3)
    assert resp.error is None and resp.shape == (3,)
    # a later submission of the same name starts the next decision
    c.add(2, [req("g")], now=2.0)
    assert c.responses() == []
    assert [name for name, *_ in c.stalled(now=10.0, after=1.0)] == ["g"]


def test_runtime_order_within_a_cycle_is_rank_order():
    c = Coordinator(3)
    for rank in range(3):
        c.add(rank, [req("g", quorum=1)])
    (resp,) = c.responses()
    assert resp.contributors == (0,) and resp.present == (0, 1, 2)


def test_quorum_counts_non_joined_ranks_only():
    c = Coordinator(3)
    c.add(2, [Request("horolite.join", Kind.JOIN, "", ())])
    c.add(0, [req("g", quorum=3)])
    assert c.responses() == []
    c.add(1, [req("g", quorum=3)])
    (resp,) = c.responses()
    assert resp.contributors == (0, 1) and resp.joined == (2,)


def test_disagreeing_quorum_or_shape_is_a_mismatch_naming_ranks():
    c = Coordinator(3)
    c.add(0, [req("g", quorum=2)])
    c.add(1, [req("g", quorum=3)])
    (resp,) = c.responses()
    assert "mismatched quorum: rank 0 had 2, rank 1 had 3" in resp.error
    assert resp.contributors == (0, 1)  # errors reach the late ranks' later submissions too
    c.add(0, [req("h", shape=(2,))])
    c.add(1, [req("h", shape=(4,))])
    (resp,) = c.responses()
    assert "mismatched shape: rank 0 had (2,), rank 1 had (4,)" in resp.error


def test_plain_allreduce_has_no_contributors():
    c = Coordinator(2)
    c.add(0, [req("g", quorum=0)])
    c.add(1, [req("g", quorum=0)])
    (resp,) = c.responses()
    assert resp.contributors == () and resp.present == ()


def test_quorum_responses_neither_fuse_nor_cache():
    plain = Response(Kind.ALLREDUCE, "a", "float32", (4,))
    quorum = Response(Kind.ALLREDUCE, "b", "float32", (4,), contributors=(0,), present=(0, 1))
    assert plan_spans([plain, quorum, plain], lambda r: 16, 1 << 20) == [(0, 1), (1, 2), (2, 3)]
    assert plan_spans([plain, plain], lambda r: 16, 1 << 20) == [(0, 2)]
    cache = ResponseCache(4)
    assert cache.cacheable(plain) and not cache.cacheable(quorum)


def test_check_quorum():
    assert check_quorum(None, Average, "t", 4) == 0
    assert check_quorum(3, Sum, "t", 4) == 3
    for bad in (0, 5, 2.5, True, "2"):
        with pytest.raises(InvalidCollectiveError, match=r"tensor 't': quorum must be an integer from 1 to 4"):
            check_quorum(bad, Average, "t", 4)
    with pytest.raises(InvalidCollectiveError, match="supports Average and Sum, not Max"):
        check_quorum(2, Max, "t", 4)
