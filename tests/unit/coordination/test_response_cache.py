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
