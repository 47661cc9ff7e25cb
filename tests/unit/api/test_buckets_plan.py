"""The bucket plan: every index once, backprop's order, the first bucket small, the cap kept."""
import random

import pytest

from horolite.api.buckets import ACROSS_HOSTS_CAP_BYTES, cap_from_setting, plan

MiB = 1 << 20


def test_one_bucket_when_the_cap_is_zero():
    assert plan([5, 6, 7], 0) == [[0, 1, 2]]
    assert plan([], 0) == [] and plan([], MiB) == []


def test_buckets_run_from_the_last_index_back_with_a_small_first_one():
    sizes = [MiB // 2] * 8  # 4 MiB in 512 KiB tensors
    assert plan(sizes, 2 * MiB, first=MiB) == [[6, 7], [2, 3, 4, 5], [0, 1]]


def test_a_tensor_larger_than_the_cap_is_a_bucket_of_its_own():
    assert plan([10, 5 * MiB, 10], MiB, first=MiB) == [[2], [1], [0]]


@pytest.mark.parametrize("seed", range(20))
def test_every_index_once_in_order_within_the_cap(seed):
    rng = random.Random(seed)
    sizes = [rng.choice([4, 1024, 300_000, 3 * MiB]) for _ in range(rng.randint(1, 60))]
    cap, first = rng.choice([MiB, 2 * MiB, 4 * MiB]), rng.choice([256 << 10, MiB])
    buckets = plan(sizes, cap, first)
    flat = [i for b in reversed(buckets) for i in b]
    assert flat == list(range(len(sizes)))  # contiguous, from the last index back
    for k, b in enumerate(buckets):
        assert b == sorted(b)
        limit = min(first, cap) if k == 0 else cap
        assert len(b) == 1 or sum(sizes[i] for i in b) <= limit
        if k + 1 < len(buckets):  # full: the next tensor (backprop's next) did not fit
            nxt = buckets[k + 1][-1]
            assert sum(sizes[i] for i in b) + sizes[nxt] > limit


def test_the_setting_auto_buckets_only_across_hosts():
    assert cap_from_setting("auto", 1) == 0 and cap_from_setting("", 1) == 0
    assert cap_from_setting("auto", 2) == ACROSS_HOSTS_CAP_BYTES
    assert cap_from_setting("0", 4) == 0
    assert cap_from_setting(" 0.5 ", 1) == MiB // 2


@pytest.mark.parametrize("value,message", [
    ("big", r"HOROLITE_GRADIENT_BUCKET_MB='big': expected `auto`, `0` \(one request per step\) "
            r"or a size in MiB"),
    ("-1", r"HOROLITE_GRADIENT_BUCKET_MB='-1' must be >= 0")])
def test_a_bad_setting_is_named(value, message):
    with pytest.raises(ValueError, match=message):
        cap_from_setting(value, 2)
