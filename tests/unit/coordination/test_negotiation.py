"""The coordinator's table and mismatch messages (pure logic, no MPI)."""
from horolite.core.messages import Kind, Request
from horolite.coordination.negotiation import Coordinator, check_requests
from horolite.core.ops import Max, Sum


def req(name="t", kind=Kind.ALLREDUCE, dtype="float32", shape=(4,), **kw):
    return Request(name=name, kind=kind, dtype=dtype, shape=shape, **kw)


def test_ready_only_when_every_rank_submitted_in_arrival_order():
    c = Coordinator(3)
    c.add(0, [req("a"), req("b")])
    c.add(1, [req("b"), req("a")])
    assert c.responses() == []
    c.add(2, [req("b")])
    assert [r.name for r in c.responses()] == ["b"]
    c.add(2, [req("a")])
    out = c.responses()
    assert [r.name for r in out] == ["a"] and out[0].error is None


def test_order_is_table_order_not_rank_order():
    c = Coordinator(2)
    c.add(1, [req("x"), req("y")])
    c.add(0, [req("y"), req("x")])
    assert [r.name for r in c.responses()] == ["x", "y"]


def test_mismatch_names_ranks_on_each_side():
    reqs = {0: req(dtype="float32"), 1: req(dtype="int32"), 2: req(dtype="float32")}
    resp = check_requests("t", reqs, 3)
    assert resp.error == "tensor 't': mismatched dtype: ranks 0, 2 had float32, rank 1 had int32"
    assert resp.error_type == "mismatch"


def test_reduce_op_and_kind_labels():
    resp = check_requests("t", {0: req(op=int(Sum)), 1: req(op=int(Max))}, 2)
    assert "mismatched reduce op: rank 0 had Sum, rank 1 had Max" in resp.error
    resp = check_requests("t", {0: req(), 1: req(kind=Kind.ALLGATHER)}, 2)
    assert "mismatched collective: rank 0 had allreduce, rank 1 had allgather" in resp.error


def test_allgather_first_dims_may_differ():
    reqs = {0: req(kind=Kind.ALLGATHER, shape=(2, 3)), 1: req(kind=Kind.ALLGATHER, shape=(5, 3))}
    resp = check_requests("g", reqs, 2)
    assert resp.error is None and resp.first_dims == (2, 5)
    reqs[1] = req(kind=Kind.ALLGATHER, shape=(5, 4))
    assert "shape beyond the first dimension" in check_requests("g", reqs, 2).error


def test_bad_root_is_invalid_not_mismatch():
    resp = check_requests("b", {0: req(kind=Kind.BROADCAST, root=5), 1: req(kind=Kind.BROADCAST, root=5)}, 2)
    assert resp.error_type == "invalid" and "root rank 5 is out of range for a job of 2 ranks" in resp.error


def test_join_counts_joined_ranks_as_present_and_reports_last():
    c = Coordinator(3)
    c.add(1, [req(kind=Kind.JOIN, name="join", dtype="", shape=())])
    c.add(0, [req("a")])
    c.add(2, [req("a")])
    out = c.responses()
    assert [r.name for r in out] == ["a"] and out[0].joined == (1,)
    c.add(2, [req(kind=Kind.JOIN, name="join", dtype="", shape=())])
    c.add(0, [req(kind=Kind.JOIN, name="join", dtype="", shape=())])
    out = c.responses()
    assert out[-1].kind == Kind.JOIN and out[-1].last_joined == 0
    assert c.joined == ()


def test_allgather_refused_while_ranks_joined():
    c = Coordinator(2)
    c.add(1, [req(kind=Kind.JOIN, name="join", dtype="", shape=())])
    c.add(0, [req("g", kind=Kind.ALLGATHER, shape=(1, 2))])
    out = c.responses()
    assert out[0].error == ("tensor 'g': allgather cannot run while rank 1 has joined; "
                            "only allreduce works with join()")


def test_stalled_lists_missing_ranks():
    c = Coordinator(4)
    c.add(0, [req("s")], now=10.0)
    c.add(2, [req("s")], now=11.0)
    assert c.stalled(now=12.0, after=5.0) == []
    (name, have, missing, waited), = c.stalled(now=16.0, after=5.0)
    assert (name, have, missing, waited) == ("s", [0, 2], [1, 3], 6.0)
