"""The control vector: OR-reducing every rank's vector yields the agreed decisions."""
import functools

import numpy as np

from horolite.coordination.control import COORDINATOR, HAS_UNSENT, JOINED, SHUTDOWN, ControlVector


def reduce_or(vectors):
    return functools.reduce(np.bitwise_or, vectors)


def test_ready_is_the_intersection_and_invalid_the_union():
    ranks = [ControlVector(200) for _ in range(3)]
    sent = [
        ranks[0].encode(HAS_UNSENT, (1 << 20, 2.5), ready=[0, 5, 64, 130, 199], invalid=[7]).copy(),
        ranks[1].encode(0, None, ready=[5, 64, 199, 3], invalid=[]).copy(),
        ranks[2].encode(JOINED, None, ready=[199, 64, 5, 0], invalid=[150]).copy(),
    ]
    decoded = ranks[1].decode(reduce_or(sent))
    assert decoded.flags == HAS_UNSENT | JOINED
    assert decoded.fusion_threshold == 1 << 20 and decoded.cycle_seconds == 0.0025
    assert decoded.ready == [5, 64, 199]
    assert decoded.invalid == [7, 150]


def test_nothing_ready_and_no_cache():
    a, b = ControlVector(1024), ControlVector(1024)
    out = reduce_or([a.encode(SHUTDOWN, (0, 1.0), [], []).copy(), b.encode(COORDINATOR, None, [1], []).copy()])
    d = a.decode(out)
    assert d.ready == [] and d.invalid == [] and d.flags == SHUTDOWN | COORDINATOR
    assert d.fusion_threshold == 0  # fusion disabled on rank 0 reaches everyone
    none = ControlVector(0)
    assert none.send.size == 3 and none.decode(none.encode(0, (5, 1.0), [], [])).ready == []


def test_many_slots_match_set_arithmetic():
    # Past a few slots the bits are set with NumPy, and whole ready words are read at
    # once: dense runs (slots are handed out lowest first) and scattered slots alike.
    rng = np.random.RandomState(7)
    for count in (0, 1, 31, 33, 64, 200, 1000):
        dense = [list(range(count)) for _ in range(3)]
        scattered = [rng.choice(1024, size=count, replace=False).tolist() for _ in range(3)]
        for ready in (dense, scattered):
            invalid = [rng.choice(1024, size=count // 3, replace=False).tolist() for _ in range(3)]
            ranks = [ControlVector(1024) for _ in range(3)]
            sent = [c.encode(0, None, r, i).copy() for c, r, i in zip(ranks, ready, invalid)]
            decoded = ranks[0].decode(reduce_or(sent))
            assert decoded.ready == sorted(set(ready[0]) & set(ready[1]) & set(ready[2]))
            assert decoded.invalid == sorted(set(invalid[0]) | set(invalid[1]) | set(invalid[2]))


def test_the_last_slot_of_a_large_cache_and_the_received_vector():
    # 4096 slots: exactly 64 words for each bitmap, the last slot in the last bit.
    ranks = [ControlVector(4096) for _ in range(2)]
    assert ranks[0].send.size == 3 + 3 * 64
    sent = [c.encode(0, None, [4095, 64], [4095]).copy() for c in ranks]
    ranks[1].received[:] = reduce_or(sent)  # what the runtime's allreduce writes into
    d = ranks[1].decode()  # default: the received vector
    assert d.ready == [64, 4095] and d.invalid == [4095]


def test_a_repeated_cycle_reuses_the_vectors_and_a_changed_one_does_not():
    # A step that repeats encodes and decodes the same vectors: kept, not rebuilt. Any
    # change (flags, setting, a slot ready or invalid) must show in both.
    a, b = ControlVector(1024), ControlVector(1024)
    first = a.encode(0, (1 << 20, 1.0), {3: None, 70: None}, set()).copy()
    assert np.array_equal(a.encode(0, (1 << 20, 1.0), {3: None, 70: None}, set()), first)
    for flags, setting, ready, invalid in [(HAS_UNSENT, (1 << 20, 1.0), [3, 70], []),
                                           (0, (1 << 21, 1.0), [3, 70], []),
                                           (0, (1 << 20, 1.0), [3], []),
                                           (0, (1 << 20, 1.0), [3, 70], [9]),
                                           (0, (1 << 20, 1.0), [3, 70], [])]:
        sent = [a.encode(flags, setting, ready, invalid).copy(),
                b.encode(0, None, [3, 70, 500], []).copy()]
        out = reduce_or(sent)
        d = b.decode(out)
        assert (d.flags, d.fusion_threshold, d.ready, d.invalid) == \
            (flags, setting[0], sorted(ready), invalid)
        assert b.decode(out.copy()) is d  # the same vector again: the same decision
