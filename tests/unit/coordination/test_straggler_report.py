"""The straggler report's travel and ageing (coordination/straggler.py, straggler_round.py):
its encoding at 1024 ranks, the window aging out with no collectives, and joins and
barriers left out of the record. Pure logic, no MPI."""
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from horolite.coordination.straggler import Report, StragglerTable, empty_report
from horolite.coordination.straggler_round import StragglerRound
from horolite.core.messages import Kind

RANKS = 1024


def big_table():
    ranks = list(range(0, 2 * RANKS, 2))  # job ranks of a process set: not 0..n-1
    hosts = [f"node{r // 8:04d}.cluster.example" for r in range(RANKS)]
    t = StragglerTable(ranks, hosts, 60.0, 0.0)
    rng = np.random.default_rng(0)
    for k in range(5):
        ages = rng.random((50, RANKS), dtype=np.float32) * 0.01
        ages[:, 7] = 0.0  # set rank 7 is last in every round
        ages[::10, 3] = np.nan  # and set rank 3 joined now and then
        t.absorb(ages, now=1.0 + k)
    return t, ranks, hosts


def test_the_report_of_1024_ranks_travels_in_32_bytes_a_rank_and_reads_the_same():
    t, ranks, hosts = big_table()
    report = t.compact(6.0)
    data = report.encode()
    assert len(data) <= 32 * RANKS + 64  # the JSON dict it replaces: about 240 KB
    back = Report.decode(data, ranks, hosts).as_dict()
    assert back == report.as_dict() == t.report(6.0)
    assert back["straggler"] == {"window": ranks[7], "total": ranks[7]}
    mine = back["ranks"][ranks[7]]["total"]
    assert mine["last"] == 250 and mine["last_share"] == 1.0
    assert mine["mean_wait_seconds"] == pytest.approx(mine["wait_seconds"] / 250)
    assert back["ranks"][ranks[0]]["total"]["mean_wait_seconds"] == 0.0
    assert sum(v["total"]["wait_share"] for v in back["ranks"].values()) == pytest.approx(1.0)
    json.dumps(back)  # plain numbers and strings


def test_every_read_is_a_new_dict_the_caller_may_change():
    t, _, _ = big_table()
    report = t.compact(6.0)
    first = report.as_dict()
    first["ranks"].clear()
    first["straggler"]["window"] = None
    assert report.as_dict()["straggler"]["window"] is not None
    assert len(report.as_dict()["ranks"]) == RANKS


def test_a_report_for_other_ranks_is_refused():
    data = empty_report([0, 1], ["a", "b"], 60.0).encode()
    with pytest.raises(ValueError, match="of 2 ranks, expected 3"):
        Report.decode(data, [0, 1, 2], ["a", "b", "c"])


def test_the_empty_report_names_nobody():
    report = Report.decode(empty_report([0, 1], ["a", "b"], 5.0).encode(), [0, 1], ["a", "b"])
    d = report.as_dict()
    assert d["straggler"] == {"window": None, "total": None}
    assert d["rounds"] == {"window": 0, "total": 0} and d["window_seconds"] == 5.0
    assert d["ranks"][1]["window"] == {"last": 0, "wait_seconds": 0.0, "mean_wait_seconds": 0.0,
                                       "last_share": 0.0, "wait_share": 0.0}


class Board:
    """A transport of one rank: gathers its own bytes, broadcasts what it is given."""

    def __init__(self):
        self.sent = None

    def gather_bytes(self, data):
        return [data, data]  # two ranks that noted the same rounds

    def bcast_bytes(self, data):
        self.sent = data
        return data


OFF = SimpleNamespace(enabled=False)


def test_a_quiet_stretch_asks_for_an_exchange_that_ages_the_window_out():
    record = StragglerRound(0, [0, 1], ["a", "b"], report_seconds=2.0)
    board, t0 = Board(), record._sent
    record.table.absorb(np.array([[0.05, 0.0]] * 20, np.float32), now=t0 + 1.0)
    record._sent = t0 + 1.0
    assert not record.due(t0 + 2.5)  # nothing new, nothing older than the window
    assert record.due(t0 + 3.1)  # the rounds of t0 + 1 are older than 2 s
    record.exchange(board, OFF, now=t0 + 3.1)
    d = record.report.as_dict()
    assert d["straggler"]["window"] is None and d["rounds"] == {"window": 0, "total": 20}
    assert d["straggler"]["total"] == 1
    assert not record.due(t0 + 100.0)  # the window is empty: no more exchanges


def test_joins_and_barriers_are_not_noted_and_the_rest_of_their_round_is():
    record = StragglerRound(1, [0, 1], ["a", "b"], report_seconds=2.0)

    def response(kind, name):
        return SimpleNamespace(kind=kind, name=name)

    def entry(submitted):
        return SimpleNamespace(submitted=submitted, taken=0.0)

    joined = [response(Kind.JOIN, "join"), response(Kind.BARRIER, "barrier")]
    assert not record.note([entry(1.0), entry(2.0)], 0.0, 5.0, OFF, joined)
    assert record.ages.count == 0
    mixed = joined + [response(Kind.ALLREDUCE, "grad")]
    record.note([entry(1.0), entry(2.0), entry(4.5)], 0.0, 5.0, OFF, mixed)
    record.note([], 4.0, 5.0, OFF, [], carried_name="small")  # carried only
    record.note([None], 0.0, 5.0, OFF, [response(Kind.ALLREDUCE, "other")])  # not this rank's
    ages = np.frombuffer(record.ages.peek(), np.float32)
    assert ages[:2].tolist() == pytest.approx([0.5, 1.0]) and math.isnan(ages[2])
