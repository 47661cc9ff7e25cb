"""The straggler table's arithmetic (coordination/straggler.py), from ages built by hand."""
import math

import numpy as np
import pytest

from horolite.coordination.straggler import Report, RoundAges, StragglerTable


def table(size=3, window=10.0):
    return StragglerTable(list(range(size)), [f"node{r}" for r in range(size)], window, 0.0)


def ages_of(rows):
    return np.array(rows, dtype=np.float32)


def test_the_last_rank_is_the_youngest_and_the_wait_is_the_spread():
    # Ranks 0 and 1 had been ready 50 ms and 48 ms when rank 2 came (1 ms before the end).
    last, wait = StragglerTable.lateness(ages_of([[0.050, 0.048, 0.001]]))
    assert last.tolist() == [2]
    assert wait[0] == pytest.approx(0.049, abs=1e-6)


def test_a_rank_without_an_entry_is_left_out_and_a_lone_rank_counts_for_nobody():
    last, wait = StragglerTable.lateness(ages_of([[math.nan, 0.03, 0.01],
                                                  [math.nan, math.nan, 0.02]]))
    assert last.tolist() == [2, -1]
    assert wait.tolist() == pytest.approx([0.02, 0.0])


def test_a_persistent_straggler_is_named_with_its_mean_wait():
    t = table()
    rows = [[0.040, 0.042, 0.002]] * 90 + [[0.0005, 0.002, 0.003]] * 10
    t.absorb(ages_of(rows), now=5.0)
    report = t.report(5.0)
    assert report["straggler"] == {"window": 2, "total": 2}
    r2 = report["ranks"][2]["total"]
    assert r2["last"] == 90 and r2["last_share"] == pytest.approx(0.9)
    assert r2["mean_wait_seconds"] == pytest.approx(0.040, abs=1e-4)
    line = t.line(5.0)
    assert line.startswith("rank 2 (host node2) was last in 90% of collectives over the last 5 s")
    assert "the others waited 40 ms per collective" in line
    assert t.summary(5.0).startswith("slowest ranks: rank 2 (host node2) ")


def test_spread_lateness_names_nobody():
    t = table()
    rows = [[0.001, 0.002, 0.0]] * 30 + [[0.0, 0.002, 0.001]] * 30 + [[0.002, 0.0, 0.001]] * 30
    t.absorb(ages_of(rows), now=5.0)
    assert t.report(5.0)["straggler"] == {"window": None, "total": None}
    assert t.line(5.0) is None and t.summary(5.0) is None


def test_a_small_wait_names_nobody_even_when_one_rank_is_always_last():
    # 100 rounds, always rank 1, 0.1 ms each: 10 ms of waiting in 5 s is under 10%.
    t = table(2)
    t.absorb(ages_of([[0.0001, 0.0]] * 100), now=5.0)
    assert t.report(5.0)["straggler"]["window"] is None


def test_the_window_forgets_old_rounds_and_the_total_keeps_them():
    t = table(2, window=2.0)
    t.absorb(ages_of([[0.05, 0.0]] * 20), now=1.0)
    t.absorb(ages_of([[0.001, 0.0]] * 5 + [[0.0, 0.001]] * 5), now=4.0)
    report = t.report(4.0)
    assert report["rounds"] == {"window": 10, "total": 30}
    assert report["ranks"][1]["total"]["last"] == 25
    assert report["ranks"][1]["window"]["last"] == 5
    assert report["straggler"]["window"] is None


def test_buffers_of_different_lengths_are_refused():
    with pytest.raises(ValueError, match="different numbers of rounds"):
        StragglerTable.decode_ages([np.zeros(3, np.float32).tobytes(),
                                    np.zeros(2, np.float32).tobytes()], 2)


def test_the_buffer_says_when_it_is_full():
    ages = RoundAges(capacity=3)
    assert not ages.note(0.1) and not ages.note(0.2)
    assert ages.note(0.3)
    assert np.frombuffer(ages.peek(), np.float32).tolist() == pytest.approx([0.1, 0.2, 0.3])
    ages.clear()
    assert ages.count == 0 and ages.peek() == b""


def test_the_report_survives_its_encoding_with_job_ranks_as_keys():
    t = StragglerTable([3, 5], ["a", "b"], 60.0, 0.0)
    t.absorb(ages_of([[0.02, 0.0]] * 12), now=1.0)
    report = t.report(1.0)
    assert Report.decode(t.compact(1.0).encode(), [3, 5], ["a", "b"]).as_dict() == report
    assert sorted(report["ranks"]) == [3, 5] and report["straggler"]["total"] == 5


def test_a_few_late_rounds_name_nobody_until_there_are_enough():
    t = table(2)
    t.absorb(ages_of([[0.05, 0.0]] * 9), now=0.5)
    assert t.report(0.5)["straggler"]["total"] is None  # 9 rounds: too few to say
    t.absorb(ages_of([[0.05, 0.0]]), now=0.55)
    assert t.report(0.55)["straggler"]["total"] == 1


def test_sub_millisecond_lateness_in_a_short_run_names_nobody():
    # Rank 1 last in every round, 0.5 ms each, 20 rounds in 0.1 s: 10% of the time,
    # yet only scheduling noise.
    t = table(2)
    t.absorb(ages_of([[0.0005, 0.0]] * 20), now=0.1)
    assert t.report(0.1)["straggler"]["total"] is None


@pytest.mark.parametrize("each, named", [(0.009, False), (0.011, True)])
def test_a_rank_is_named_once_the_others_spend_a_tenth_of_the_time_waiting_for_it(each, named):
    # 20 rounds in 2 s, rank 1 always last: 9 ms each is 9% of the time, 11 ms is 11%.
    t = table(2, window=2.0)
    t.absorb(ages_of([[each, 0.0]] * 20), now=2.0)
    assert (t.report(2.0)["straggler"]["window"] == 1) is named
