"""Fusion planning is a pure function of the response list and sizes."""
import numpy as np

from horolite.execution.fusion import plan_spans
from horolite.core.messages import Kind, Response


def ar(name, n, dtype="float32", op=1, **kw):
    return Response(kind=Kind.ALLREDUCE, name=name, dtype=dtype, shape=(n,), op=op, **kw)


def size(resp):
    return resp.shape[0] * np.dtype(resp.dtype).itemsize


def names(rs, threshold):
    """The planned batches, as lists of names."""
    return [[r.name for r in rs[a:b]] for a, b in plan_spans(rs, size, threshold)]


def test_consecutive_compatible_tensors_fuse_up_to_threshold():
    rs = [ar("a", 10), ar("b", 10), ar("c", 10)]
    assert names(rs, 80) == [["a", "b"], ["c"]]
    assert names(rs, 1000) == [["a", "b", "c"]]


def test_threshold_zero_disables_fusion():
    rs = [ar("a", 1), ar("b", 1)]
    assert names(rs, 0) == [["a"], ["b"]]


def test_bigger_than_threshold_runs_alone():
    rs = [ar("a", 1), ar("big", 1000), ar("b", 1)]
    assert names(rs, 100) == [["a"], ["big"], ["b"]]


def test_different_dtype_op_scale_or_kind_break_batches():
    rs = [ar("a", 1), ar("b", 1, dtype="float64"), ar("c", 1, dtype="float64", op=3),
          ar("d", 1, dtype="float64", op=3, prescale=2.0),
          Response(kind=Kind.BROADCAST, name="e", dtype="float64", shape=(1,)),
          ar("f", 1, dtype="float64", op=3, prescale=2.0), ar("g", 1, error="x")]
    assert names(rs, 1 << 20) == [["a"], ["b"], ["c"], ["d"], ["e"], ["f"], ["g"]]


def test_output_pool_reuses_only_dropped_arrays_and_stays_bounded():
    from horolite.execution.output_pool import OutputPool
    pool = OutputPool()
    pool.MAX_ARRAYS = 2  # (the default keeps more: enough for a caller holding two steps' results)
    f32 = np.dtype(np.float32)
    a = pool.empty((1 << 18,), f32)  # 1 MiB: pooled (views of kept arrays)
    b = pool.empty((1 << 18,), f32)
    assert a.base is not b.base and pool._held == 2 << 20
    view = a[:4]
    a_base = a.base
    del a
    c = pool.empty((1 << 18,), f32)  # a lives on through the view, b is held: a new array
    assert c.base is not a_base and c.base is not b.base and view.base is a_base
    del a_base
    b_id = id(b.base)
    del b, c
    assert id(pool.empty((1 << 18,), f32).base) == b_id  # dropped: handed out again
    # another shape of the same size class: the same kept array, shaped as asked
    d = pool.empty((1000, 260), f32)
    assert d.shape == (1000, 260) and id(d.base) == b_id and d.flags.c_contiguous
    del d
    assert pool.empty((10,), f32).nbytes == 40 and pool._held == 2 << 20  # small: not pooled
    pool.MAX_BYTES = 2 << 20
    for _ in range(3):
        pool.empty((1 << 19,), f32)  # 2 MiB each, over the cap: never kept
    assert pool._held == 2 << 20


def test_output_pool_reuses_while_the_caller_holds_two_steps_results():
    import collections
    from horolite.execution.output_pool import OutputPool
    pool = OutputPool()
    f32 = np.dtype(np.float32)
    held = collections.deque(maxlen=2)  # the last two steps' results, as views
    seen = set()
    for step in range(12):
        # a fused batch's size moves a little from step to step
        out = pool.empty(((1 << 18) - 64 * (step % 3),), f32)
        assert all(out.base is not h.base for h in held)  # never one the caller still holds
        seen.add(id(out.base))
        held.append(out[1:])
        del out
    assert len(seen) == 3 and pool._held == 3 << 20  # no fresh array after the third step


def test_group_layout_pads_members_to_64_bytes():
    from horolite.api.grouping import _layout
    spans, total, gaps = _layout(((10,), (2, 3), (16,), (5,)), 4)
    # float32: 16 elements per 64 bytes; no padding after the last member
    assert [s.start for s, _ in spans] == [0, 16, 32, 48]
    assert [s.stop - s.start for s, _ in spans] == [10, 6, 16, 5]
    assert [shape for _, shape in spans] == [None, (2, 3), None, None]
    assert gaps == (6, 10, 0, 0) and total == 53
    # sizes that are already multiples of 64 bytes need no padding at all
    assert _layout(((1024,), (1024,)), 4)[2] == ()
    assert _layout(((3,), (5,)), 1)[0][1][0] == slice(64, 69)


def test_only_clean_allreduces_fuse_even_with_identical_fields():
    # Same dtype, op and scales as their neighbours: a broadcast, an allgather, an error
    # and a quorum allreduce each still run alone (found by mutation testing, docs/testing.md).
    for odd in (Response(kind=Kind.BROADCAST, name="x", dtype="float32", shape=(1,), op=1),
                Response(kind=Kind.ALLGATHER, name="x", dtype="float32", shape=(1,), op=1),
                ar("x", 1, error="shapes differ"), ar("x", 1, contributors=(0, 1))):
        rs = [ar("a", 1), odd, ar("c", 1), ar("d", 1)]
        assert names(rs, 1 << 20) == [["a"], ["x"], ["c", "d"]], odd


def test_empty_tensors_fuse_and_a_zero_threshold_fuses_nothing():
    rs = [ar("a", 0), ar("b", 0), ar("c", 2)]
    assert names(rs, 8) == [["a", "b", "c"]]
    assert names(rs, 0) == [["a"], ["b"], ["c"]]
    assert names(rs, 1) == [["a", "b"], ["c"]]  # a threshold of 1 byte still fuses what fits


def test_every_field_of_the_fusion_key_breaks_a_batch():
    for field, value in (("dtype", "float64"), ("op", 2), ("prescale", 0.5), ("postscale", 0.5),
                         ("device", "cuda:0"), ("joined", (1,))):
        rs = [ar("a", 1), ar("b", 1), ar("x", 1, **{field: value}), ar("y", 1, **{field: value})]
        assert names(rs, 1 << 20) == [["a", "b"], ["x", "y"]], field


def test_output_pool_forgets_free_arrays_of_old_sizes_when_full():
    # A job whose results change size (another model, evaluation) gets pooled arrays again:
    # free arrays are forgotten, least recently used first, only when that makes room.
    from horolite.execution.output_pool import OutputPool
    pool = OutputPool()
    pool.MAX_BYTES = 4 << 20
    f32 = np.dtype(np.float32)
    import weakref
    old = [pool.empty((1 << 18,), f32) for _ in range(4)]  # 4 x 1 MiB: full
    bases = [weakref.ref(o.base) for o in old]
    held = old[1]
    del old
    again = pool.empty((1 << 18,), f32)  # reused, and now the most recently used
    assert again.base is bases[0]()
    del again
    new = pool.empty((1 << 19,), f32)  # 2 MiB: the two least recently used free ones go
    assert pool._held == 4 << 20
    kept = pool._arrays[f32]
    assert [b() is not None for b in bases] == [True, True, False, False]
    assert any(a is bases[1]() for a in kept), "an array the caller holds was forgotten"
    assert any(a is new.base for a in kept) and len(kept) == 3
    # no room can be made (all but one 1 MiB held): nothing is forgotten, and unpooled
    big = pool.empty((1 << 20,), f32)
    assert len(pool._arrays[f32]) == 3 and pool._held == 4 << 20
    assert not any(a is big.base for a in pool._arrays[f32]) and held is not None


def test_result_arena_hands_released_ranges_out_again():
    from mpi4py import MPI
    from horolite.transport.result_arena import PAGE, ResultArena
    arena = ResultArena(MPI.COMM_SELF, 64 * PAGE)
    f32 = np.dtype(np.float32)
    a, b, c = (arena.empty((n * PAGE // 4,), f32) for n in (4, 8, 4))
    start = lambda x: x.__array_interface__["data"][0]
    assert start(b) - start(a) == 4 * PAGE and start(c) - start(b) == 8 * PAGE
    b[:] = 7
    arena.release(b)
    d = arena.empty((3 * PAGE // 4,), f32)  # first fit: in b's range
    assert start(d) == start(b)
    e = arena.empty((5 * PAGE // 4,), f32)  # the 5 pages left of it
    assert start(e) == start(b) + 3 * PAGE
    arena.release(c)  # the last range: the bump pointer moves back
    arena.release(e)
    f = arena.empty((60 * PAGE // 4,), f32)  # too large now...
    assert f is None
    arena.release(d)
    g = arena.empty((60 * PAGE // 4,), f32)  # ...fits once all after `a` is free again
    assert g is not None and start(g) == start(a) + 4 * PAGE
    assert arena.owns(g) and not arena.owns(np.zeros(3))
    arena.close()
