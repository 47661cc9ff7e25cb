"""Whom the launcher evicts for the ranks' blames (launcher/elastic_blames.py)."""
import importlib

from test_launcher_cli import _import_launcher

_import_launcher()
blames_mod = importlib.import_module("horolite.launcher.elastic_blames")
standing, to_evict, Blame = blames_mod.standing, blames_mod.to_evict, blames_mod.Blame
W4 = ["w0", "w1", "w2", "w3"]


def items(**by_key):
    return {k.replace("_", "."): v.encode() for k, v in by_key.items()}


def test_a_partition_whose_halves_both_reach_the_launcher_is_broken_by_majority():
    # 2 | 2: nobody was evicted before (every blamed rank had blamed, so all were excused)
    b = standing(items(blame_1_w0="2,3", blame_1_w1="2,3", blame_1_w2="0,1",
                       blame_1_w3="0,1"), {1: W4}, W4, {})
    assert sorted(to_evict(b, W4)) == ["w2", "w3"]  # a tie: the side of the oldest rank stays
    # 3 | 1: the lone rank goes, whatever its rank
    b = standing(items(blame_1_w1="0", blame_1_w2="0", blame_1_w3="0", blame_1_w0="1,2,3"),
                 {1: W4}, W4, {})
    assert sorted(to_evict(b, W4)) == ["w0"]
    assert "named each other" in to_evict(b, W4)["w0"][1]


def test_who_left_on_purpose_is_excused_and_who_hangs_is_not():
    # w2 blamed w3 (it stalled on it) and left; w0 and w1 then lost w2: only w3 goes
    b = standing(items(blame_1_w2="3", blame_1_w0="2", blame_1_w1="2"), {1: W4}, W4, {})
    assert to_evict(b, W4) == {"w3": (1, "was named by w2 as a rank it lost")}


def test_blames_of_every_generation_count_until_someone_enters_a_newer_world():
    plans = {1: ["w0", "w1", "w2"], 2: ["w0", "w1", "w2", "w3"]}
    members = plans[2]
    # w2 hung in generation 1 after plan 2 was out (a join pending): the blame of
    # generation 1 still names it; rank 2 of generation 1 is w2
    b = standing(items(blame_1_w0="2", blame_1_w1="2"), plans, members, {"w0": 1, "w1": 1})
    assert list(to_evict(b, members)) == ["w2"]
    # the blamer entered generation 2 since: its blame of generation 1 no longer stands
    assert standing(items(blame_1_w0="2"), plans, members, {"w0": 2}) == []
    # the blamed worker entered generation 2 since: it was alive after
    assert to_evict(standing(items(blame_1_w0="2"), plans, members, {"w0": 1, "w2": 2}),
                    members) == {}
    # a blame by a worker no longer a member (evicted, it came back) is not read
    assert standing(items(blame_1_w9="0"), {1: ["w0", "w9"]}, ["w0"], {}) == []
    # a rank whose world did not form names whom it waited for, in that generation's ranks
    b = standing(items(blame_2_w3="1"), plans, members, {"w0": 1, "w1": 1})
    assert to_evict(b, members) == {"w1": (2, "was named by w3 as a rank it lost")}


def test_ranks_that_wait_on_each_other_for_a_stopped_one_are_not_a_partition():
    # w2 stopped inside the new world's set-up; w0 and w1 wait on each other and on it
    members = ["w0", "w1", "w2"]
    b = standing(items(blame_1_w0="1,2", blame_1_w1="0,2"), {1: members}, members, {})
    assert list(to_evict(b, members)) == ["w2"]


def test_a_rank_that_named_one_evicted_since_left_on_purpose():
    # w0 waited for w2 (evicted since: not a member); w1 waited for w0 meanwhile
    members = ["w0", "w1"]
    b = standing(items(blame_1_w0="2", blame_1_w1="0"), {1: ["w0", "w1", "w2"]}, members, {})
    assert to_evict(b, members) == {}


def test_once_the_stopped_rank_is_evicted_those_that_waited_on_each_other_stay():
    members = ["w0", "w1"]  # (w2 evicted in generation 1)
    b = standing(items(blame_1_w0="1,2", blame_1_w1="0,2"), {1: ["w0", "w1", "w2"]},
                 members, {})
    assert to_evict(b, members, decided={1}) == {}
