"""Response cache: hits, invalidation, LRU eviction, identical slot assignment."""
from horolite.core.messages import Kind, Request, Response
from horolite.coordination.response_cache import HIT, INVALID, MISS, ResponseCache


def req(name, shape=(4,)):
    return Request(name=name, kind=Kind.ALLREDUCE, dtype="float32", shape=shape)


def put(cache, name, shape=(4,)):
    r = req(name, shape)
    return cache.put(r, Response.from_request(r))


def test_hit_miss_invalid():
    c = ResponseCache(4)
    assert c.lookup(req("a")) == (MISS, -1)
    put(c, "a")
    assert c.lookup(req("a")) == (HIT, 0)
    assert c.lookup(req("a", (5,))) == (INVALID, 0)
    c.erase(0)
    assert c.lookup(req("a")) == (MISS, -1) and len(c) == 0


def test_lru_eviction_returns_the_slot_and_is_deterministic():
    a, b = ResponseCache(2), ResponseCache(2)
    for c in (a, b):
        put(c, "x")
        put(c, "y")
        c.touch([c.lookup(req("x"))[1]])
        assert put(c, "z") == 1  # y was least recently used
    assert a.lookup(req("z")) == b.lookup(req("z")) == (HIT, 1)
    assert a.lookup(req("y")) == (MISS, -1)


def test_errors_joined_and_barriers_are_not_cacheable():
    c = ResponseCache(4)
    assert not c.cacheable(Response(kind=Kind.ALLREDUCE, name="e", error="boom"))
    assert not c.cacheable(Response(kind=Kind.ALLREDUCE, name="j", joined=(1,)))
    assert not c.cacheable(Response(kind=Kind.BARRIER, name="b"))
    assert c.cacheable(Response(kind=Kind.ALLGATHER, name="g"))
    assert not ResponseCache(0).cacheable(Response(kind=Kind.ALLREDUCE, name="x"))


def test_put_again_keeps_the_slot_with_the_new_parameters():
    c = ResponseCache(2)
    assert put(c, "a") is None and put(c, "b") is None  # no eviction: None, nothing else
    assert put(c, "a", (9,)) is None  # the same name again: its slot, nothing evicted
    assert c.lookup(req("a", (9,))) == (HIT, 0) and c.lookup(req("a")) == (INVALID, 0)
    assert len(c) == 2 and c.evictions == 0
    assert c.responses([0])[0].shape == (9,)


def test_responses_returns_the_slots_and_marks_them_used():
    c = ResponseCache(2)
    put(c, "a")
    put(c, "b")
    assert [r.name for r in c.responses([1, 0])] == ["b", "a"]
    c.responses([0])  # "a" used last: "b" goes first
    assert put(c, "c") == 1 and c.lookup(req("b")) == (MISS, -1) and c.evictions == 1
    assert put(c, "d") == 0 and c.evictions == 2


def test_eviction_follows_use_not_slot_order():
    c = ResponseCache(2)
    put(c, "x")
    put(c, "y")
    c.erase(0)  # x's slot is free again, and "z" takes it: z (slot 0) is newer than y (slot 1)
    assert put(c, "z") is None and c.lookup(req("z")) == (HIT, 0)
    assert put(c, "w") == 1 and c.lookup(req("y")) == (MISS, -1)


def test_a_cache_of_one_slot_caches():
    c = ResponseCache(1)
    r = req("a")
    assert c.cacheable(Response.from_request(r))
    assert not ResponseCache(0).cacheable(Response.from_request(r))
    put(c, "a")
    assert put(c, "b") == 0 and c.lookup(req("b")) == (HIT, 0) and c.evictions == 1
