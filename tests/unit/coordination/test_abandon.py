"""Abandon notices at rank 0: a notice for a group covers it in whichever form the other
ranks sent it (one request, or the separate members of a group that could not be packed),
and is answered only once they have sent all of it (pure logic, no MPI)."""
import pytest

from horolite.core.messages import Kind, Request
from horolite.coordination.negotiation import Coordinator
from horolite.elastic.run import is_runtime_failure
from horolite.errors import HorovodInternalError
from horolite.execution.executor import _error_for

WHY = "its previous run of this step failed there"


def req(name, members=0, dtype="float32"):
    return Request(name=name, kind=Kind.ALLREDUCE, dtype=dtype, shape=(4,), members=members)


def notice(name, why=WHY):
    return Request(name=name, kind=Kind.ALLREDUCE, dtype="", shape=(), abandoned=why)


def failed(responses):
    return {r.name: (r.error, r.error_type, r.peer) for r in responses}


def test_a_notice_fails_every_member_of_a_group_sent_separately_once_all_arrived():
    c = Coordinator(3)
    c.add(1, [notice("g")])
    c.add(0, [req("g.0", 3), req("g.1", 3, "float64")])
    c.add(2, [req("g.0", 3), req("g.1", 3, "float64"), req("g.2", 3)])
    assert c.responses() == []  # rank 0's g.2 is still to come: its old one must not stay
    c.add(0, [req("g.2", 3)])
    out = c.responses()
    assert [r.name for r in out] == ["g.0", "g.1", "g.2", "g"]
    for r in out:
        assert r.error == f"tensor '{r.name}': rank 1 will never send it: {WHY}"
        assert (r.error_type, r.peer) == ("abandoned", 1)
    assert c.stalled(now=1e12, after=0.0) == []  # nothing left in the table
    # the next run pairs as usual
    for rank in range(3):
        c.add(rank, [req("g.0", 3)])
    assert [(r.name, r.error) for r in c.responses()] == [("g.0", None)]


def test_a_notice_waits_for_a_rank_that_sent_none_of_the_group_yet():
    c = Coordinator(3)
    c.add(1, [notice("g")])
    c.add(0, [req("g.0", 2), req("g.1", 2)])
    assert c.responses() == []
    c.add(2, [req("g.0", 2), req("g.1", 2)])
    assert sorted(failed(c.responses())) == ["g", "g.0", "g.1"]


def test_one_request_or_separate_members_both_settle():
    c = Coordinator(3)
    c.add(2, [notice("g")])
    c.add(0, [req("g")])  # packed
    c.add(1, [req("g.0", 1)])  # one member alone (Adasum, a device array)
    out = failed(c.responses())
    assert sorted(out) == ["g", "g.0"] and {v[2] for v in out.values()} == {2}


def test_only_members_of_a_separate_group_are_covered():
    c = Coordinator(2)
    c.add(1, [notice("g")])
    c.add(0, [req("g.7"), req("g.x", 1), req("g")])  # g.7: a tensor of its own (no members)
    assert [r.name for r in c.responses()] == ["g"]
    c.add(1, [req("g.7")])
    assert [(r.name, r.error) for r in c.responses()] == [("g.7", None)]


def test_two_ranks_give_up_and_a_joined_rank_is_not_waited_for():
    c = Coordinator(4)
    c.add(3, [Request("horolite.join", Kind.JOIN, "", ())])
    c.add(1, [notice("g", "one")])
    c.add(2, [notice("g", "two")])
    c.add(0, [req("g.0", 1)])
    out = c.responses()
    assert out[0].error == "tensor 'g.0': ranks 1, 2 will never send it: one"
    assert out[0].peer == 1


def test_a_process_set_names_job_ranks():
    c = Coordinator(2, names=[3, 5])
    c.add(1, [notice("g")])
    c.add(0, [req("g.0", 1)])
    out = c.responses()
    assert [(r.name, r.peer) for r in out] == [("g.0", 5), ("g", 5)]
    assert "rank 5 will never send it" in out[0].error


def test_the_error_is_a_runtime_failure_naming_the_peer():
    c = Coordinator(2)
    c.add(1, [notice("g")])
    c.add(0, [req("g.0", 1)])
    error = _error_for(c.responses()[0])
    assert isinstance(error, HorovodInternalError) and not isinstance(error, ValueError)
    assert error.horolite_peer == 1 and is_runtime_failure(error)
    with pytest.raises(HorovodInternalError, match="rank 1 will never send it"):
        raise error
