"""Where the exchange lane runs (HOROLITE_EXCHANGE_PIPELINE) and which agreed lists it takes."""
import pytest

from horolite.core.messages import Kind, Response
from horolite.core.ops import ReduceOp
from horolite.execution.lane import lane_wanted, pipelines


@pytest.mark.parametrize("setting,hosts,multiple,on", [
    ("auto", 1, True, False), ("auto", 2, True, True), (" AUTO ", 3, True, True),
    ("1", 1, True, True), ("0", 2, True, False), ("1", 2, False, False),
    ("auto", 2, False, False)])
def test_the_setting_and_the_hosts_choose(setting, hosts, multiple, on):
    assert lane_wanted(setting, hosts, multiple) is on


def test_a_bad_setting_is_named():
    with pytest.raises(ValueError, match=r"HOROLITE_EXCHANGE_PIPELINE='yes': expected auto, 0 or 1"):
        lane_wanted("yes", 2, True)


def response(**changes):
    fields = dict(kind=Kind.ALLREDUCE, name="t", dtype="float32", shape=(4,), op=ReduceOp.SUM)
    fields.update(changes)
    return Response(**fields)


def test_only_plain_host_allreduces_go_to_the_lane():
    assert pipelines([response(), response(name="u")])
    for other in (dict(kind=Kind.BROADCAST), dict(kind=Kind.ALLGATHER), dict(device="cuda:0"),
                  dict(error="shapes differ"), dict(contributors=(0, 1)), dict(joined=(1,)),
                  dict(op=ReduceOp.ADASUM)):
        assert not pipelines([response(), response(name="u", **other)]), other
