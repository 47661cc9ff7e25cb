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


# Every way two ranks' requests can disagree or be invalid, with Horovod-style messages that
# name the ranks on each side (the rank-side tests check the same under mpirun; these pin
# the exact texts, kinds and error types in one process: found by mutation testing).
CASES = [
    ({"device": "cuda:0"}, {}, "mismatch", "mismatched device: rank 0 had cuda:0, rank 1 had cpu"),
    ({"root": 1}, {}, "mismatch", "mismatched root rank: rank 0 had 1, rank 1 had -1"),
    ({"prescale": 2.0}, {}, "mismatch", "mismatched prescale factor: rank 0 had 2.0, rank 1 had 1.0"),
    ({"postscale": 0.5}, {}, "mismatch", "mismatched postscale factor: rank 0 had 0.5, rank 1 had 1.0"),
    ({"quorum": 1}, {}, "mismatch", "mismatched quorum: rank 0 had 1, rank 1 had 0"),
    ({"op": 77}, {}, "mismatch", "mismatched reduce op: rank 0 had 77, rank 1 had Average"),
    ({"shape": (4,)}, {"shape": (5,)}, "mismatch", "mismatched shape: rank 0 had (4,), rank 1 had (5,)"),
    ({"group": ((2,), (3,))}, {}, "mismatch",
     "mismatched group member shapes: rank 0 had [(2,), (3,)], rank 1 had no group"),
    ({"kind": Kind.ALLGATHER, "shape": (2, 3)}, {"kind": Kind.ALLGATHER, "shape": (2,)}, "mismatch",
     "mismatched number of dimensions: rank 0 had 2, rank 1 had 1"),
    ({"kind": Kind.ALLTOALL, "shape": (2, 3)}, {"kind": Kind.ALLTOALL, "shape": (5, 4)}, "mismatch",
     "mismatched shape beyond the first dimension: rank 0 had (3,), rank 1 had (4,)"),
    ({"kind": Kind.ALLGATHER, "shape": ()}, {"kind": Kind.ALLGATHER, "shape": ()}, "invalid",
     "allgather needs at least one dimension, got a scalar"),
    ({"kind": Kind.BROADCAST, "root": 2}, {"kind": Kind.BROADCAST, "root": 2}, "invalid",
     "root rank 2 is out of range for a job of 2 ranks"),
    ({"kind": Kind.BROADCAST, "root": -1}, {"kind": Kind.BROADCAST, "root": -1}, "invalid",
     "root rank -1 is out of range for a job of 2 ranks"),
]


def test_every_disagreement_and_invalid_request_has_its_message():
    import pytest
    for mine, other, error_type, message in CASES:
        reqs = {0: req("t", **mine), 1: req("t", **other)}
        resp = check_requests("t", reqs, 2)
        assert (resp.kind, resp.name, resp.error, resp.error_type) == \
            (reqs[0].kind, "t", f"tensor 't': {message}", error_type), mine
    # what is valid: a scalar allreduce, a 1-d allgather with different first dimensions,
    # root 0 and the last rank of a broadcast
    for mine, other in (({"shape": ()}, {"shape": ()}),
                        ({"kind": Kind.ALLGATHER, "shape": (1, 3)}, {"kind": Kind.ALLGATHER, "shape": (4, 3)}),
                        ({"kind": Kind.BROADCAST, "root": 0}, {"kind": Kind.BROADCAST, "root": 0}),
                        ({"kind": Kind.BROADCAST, "root": 1}, {"kind": Kind.BROADCAST, "root": 1})):
        assert check_requests("t", {0: req("t", **mine), 1: req("t", **other)}, 2).error is None
    with pytest.raises(ValueError):
        check_requests("t", {}, 2)


def test_joined_ranks_allow_only_allreduce_and_barrier():
    for kind, ok in ((Kind.ALLREDUCE, True), (Kind.BARRIER, True), (Kind.ALLGATHER, False),
                     (Kind.BROADCAST, False)):
        shape = (2,) if kind == Kind.ALLGATHER else (4,)
        resp = check_requests("t", {0: req("t", kind=kind, shape=shape, root=0)}, 3, joined=[2, 1])
        if ok:
            assert resp.error is None and resp.joined == (1, 2)
        else:
            assert resp.error == (f"tensor 't': {kind.label} cannot run while ranks 1, 2 have "
                                  "joined; only allreduce works with join()")
            assert resp.error_type == "invalid"
    resp = check_requests("t", {0: req("t", kind=Kind.BROADCAST, root=0)}, 2, joined=[1])
    assert "while rank 1 has joined" in resp.error


def test_allgather_first_dims_cover_every_rank():
    reqs = {r: req("t", kind=Kind.ALLGATHER, shape=(n, 2)) for r, n in ((0, 3), (1, 0), (2, 1))}
    assert check_requests("t", reqs, 3).first_dims == (3, 0, 1)


def test_a_process_sets_coordinator_names_job_ranks():
    # A set of job ranks [3, 5, 6]: its coordinator counts 0..2 but every message and stall
    # report names job ranks.
    c = Coordinator(3, names=[3, 5, 6])
    c.add(0, [req("t", dtype="float32"), req("late")], now=10.0)
    c.add(1, [req("t", dtype="int32")], now=10.0)
    c.add(2, [req(kind=Kind.JOIN, name="join", dtype="", shape=()), req("u", kind=Kind.BROADCAST, root=0)],
          now=10.0)  # the requests after a JOIN in the same list still count
    out = c.responses()
    assert [r.name for r in out] == ["t"]
    assert out[0].error == "tensor 't': mismatched dtype: rank 3 had float32, rank 5 had int32"
    assert c.stalled(now=12.5, after=2.0) == [("late", [3], [5], 2.5), ("u", [6], [3, 5], 2.5)]
    assert c.stalled(now=11.0, after=2.0) == []


def test_an_abandoned_tensor_fails_on_every_rank_naming_who_and_why():
    reqs = {0: req(), 1: req(dtype="", shape=(), abandoned="its step failed"), 2: req()}
    resp = check_requests("t", reqs, 3)
    assert resp.error == "tensor 't': rank 1 will never send it: its step failed"
    assert (resp.error_type, resp.peer) == ("abandoned", 1)  # a peer's failure, not a mismatch
