"""Every collective x dtype x op on the real MPI transport, against NumPy references.

Runs on every rank under mpirun (tests/test_matrix_core.py). Each rank's input
is a pure function of (rank, tensor), so every rank can build the reference
from all ranks' inputs locally.
"""
import os
import zlib

import ml_dtypes
import numpy as np
import pytest

import horolite as hvd

from float16_sums import rounding_sums
from pretend_hosts import expected_topology, hierarchical_applies

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()

DTYPES = ["uint8", "int8", "uint16", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64"]
OPS = [hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product]
SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 0, 3), (1031,)]
BIG = int(os.environ.get("HOROLITE_TEST_BIG_ELEMENTS", "70001"))


def np_dtype(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def make(rank, shape, dtype, key, low=0, high=5):
    seed = zlib.crc32(repr((rank, key)).encode())
    rng = np.random.RandomState(seed)
    return rng.randint(low, high, size=shape).astype(np.float64).astype(np_dtype(dtype))


def reference(op, arrays, dtype):
    stack = np.stack([a.astype(np.float64) for a in arrays])
    if op in (hvd.Sum, hvd.Average):
        out = stack.sum(axis=0)
        if op == hvd.Average:
            out = out / len(arrays)
            if np.dtype(np_dtype(dtype)).kind in "iu":
                out = np.trunc(out)
    elif op == hvd.Min:
        out = stack.min(axis=0)
    elif op == hvd.Max:
        out = stack.max(axis=0)
    else:
        out = stack.prod(axis=0)
    return out


def assert_close(got, want, dtype):
    assert got.shape == want.shape, (got.shape, want.shape)
    got = got.astype(np.float64)
    if dtype == "bfloat16":
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=1e-2)
    elif dtype == "float16":
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=1e-3)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
def test_allreduce(dtype, op):
    # Submit every shape asynchronously so they meet in the same cycles and fuse.
    handles, refs = [], []
    for i, shape in enumerate(SHAPES):
        key = (dtype, int(op), i)
        # Products stay small (<= 2**4) so int8 does not wrap.
        high = 3 if op == hvd.Product else 5
        x = make(RANK, shape, dtype, key, high=high)
        before = x.copy()
        handles.append((hvd.allreduce_async(x, op=op, name=f"ar.{dtype}.{op.name}.{i}"), x, before))
        refs.append(reference(op, [make(r, shape, dtype, key, high=high) for r in range(SIZE)], dtype))
    for (h, x, before), want in zip(handles, refs):
        got = hvd.synchronize(h)
        assert got.dtype == np_dtype(dtype)
        assert_close(got, want, dtype)
        assert np.array_equal(x, before), "input was modified"


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "float16"])
def test_allreduce_large_and_scaled(dtype):
    key = ("big", dtype)
    x = make(RANK, (BIG,), dtype, key)
    got = hvd.allreduce(x, op=hvd.Sum, name=f"big.{dtype}", prescale_factor=0.5, postscale_factor=3.0)
    want = reference(hvd.Sum, [make(r, (BIG,), dtype, key).astype(np.float64) * 0.5
                               for r in range(SIZE)], dtype) * 3.0
    if np_dtype(dtype).kind in "iu":
        # Integers: prescale truncates each input, postscale truncates the sum.
        want = np.trunc(reference(hvd.Sum, [np.trunc(make(r, (BIG,), dtype, key) * 0.5)
                                            for r in range(SIZE)], dtype) * 3.0)
    assert_close(got, want, dtype)


def test_average_is_default_and_named_repeat_uses_cache():
    x = np.full(5, float(RANK + 1), dtype=np.float32)
    want = np.full(5, (SIZE + 1) / 2.0)
    for _ in range(4):
        np.testing.assert_allclose(hvd.allreduce(x, name="repeat"), want)


def test_different_submission_order_per_rank():
    names = [f"order.{i}" for i in range(12)]
    order = list(names)
    np.random.RandomState(RANK).shuffle(order)
    handles = {n: hvd.allreduce_async(np.full(3, float(RANK + int(n.split('.')[1])), np.float64),
                                      op=hvd.Sum, name=n) for n in order}
    for n in names:
        i = int(n.split('.')[1])
        np.testing.assert_allclose(hvd.synchronize(handles[n]), np.full(3, sum(r + i for r in range(SIZE))))


def test_grouped_allreduce():
    arrays = [make(RANK, s, "float32", ("g", i)) for i, s in enumerate([(3,), (4, 2), ()])]
    got = hvd.grouped_allreduce(arrays, op=hvd.Sum, name="group")
    for i, (g, s) in enumerate(zip(got, [(3,), (4, 2), ()])):
        assert_close(g, reference(hvd.Sum, [make(r, s, "float32", ("g", i)) for r in range(SIZE)],
                                  "float32"), "float32")


@pytest.mark.parametrize("dtype", DTYPES + ["bool"])
def test_allgather_uneven_first_dim(dtype):
    def rows(r):
        return (r * 2 + 1) % 4  # 1, 3, 1, 3 rows: includes uneven sizes

    def part(r):
        if dtype == "bool":
            return (np.arange(rows(r) * 3).reshape(rows(r), 3) + r) % 2 == 0
        return make(r, (rows(r), 3), dtype, ("ag", dtype))

    handle = hvd.allgather_async(part(RANK), name=f"ag.{dtype}")
    got = hvd.synchronize(handle)
    assert handle.first_dims == tuple(rows(r) for r in range(SIZE))
    want = np.concatenate([part(r) for r in range(SIZE)])
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.array_equal(got.astype(np.float64), want.astype(np.float64))


def test_allgather_zero_rows_on_some_ranks():
    x = np.full((RANK % 2, 2), RANK, dtype=np.int32)
    got = hvd.allgather(x, name="ag.zero")
    want = np.concatenate([np.full((r % 2, 2), r, dtype=np.int32) for r in range(SIZE)])
    assert np.array_equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES + ["bool"])
def test_broadcast_every_root(dtype):
    for root in range(SIZE):
        x = make(RANK, (4, 3), dtype, ("bc", dtype)) if dtype != "bool" else np.full(5, RANK == root)
        got = hvd.broadcast(x, root_rank=root, name=f"bc.{dtype}.{root}")
        want = make(root, (4, 3), dtype, ("bc", dtype)) if dtype != "bool" else np.full(5, True)
        assert np.array_equal(got.astype(np.float64), want.astype(np.float64))


def test_broadcast_scalar_and_empty():
    assert hvd.broadcast(np.float64(RANK + 7), root_rank=0, name="bc.scalar") == 7
    assert hvd.broadcast(np.zeros((0, 4)), root_rank=SIZE - 1, name="bc.empty").shape == (0, 4)


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int16", "int64", "float16", "bfloat16", "float32", "bool"])
def test_alltoall_with_splits(dtype):
    # Rank r sends (r + d) % 3 rows to rank d; each row is tagged with sender and destination.
    def splits_of(r):
        return np.array([(r + d) % 3 for d in range(SIZE)])

    def rows_for(r, d):
        n = (r + d) % 3
        block = np.full((n, 2), r * 10 + d, dtype=np.float64)
        return (block % 2 == 0) if dtype == "bool" else block.astype(np_dtype(dtype))

    send = np.concatenate([rows_for(RANK, d) for d in range(SIZE)])
    out, recv_splits = hvd.alltoall(send, splits=splits_of(RANK), name=f"a2a.{dtype}")
    want = np.concatenate([rows_for(s, RANK) for s in range(SIZE)])
    assert np.array_equal(recv_splits, [splits_of(s)[RANK] for s in range(SIZE)])
    assert np.array_equal(out.astype(np.float64), want.astype(np.float64))


def test_alltoall_even_default():
    send = np.arange(SIZE * 2, dtype=np.int32) + 100 * RANK
    out = hvd.alltoall(send, name="a2a.even")
    want = np.concatenate([np.arange(RANK * 2, RANK * 2 + 2, dtype=np.int32) + 100 * s for s in range(SIZE)])
    assert np.array_equal(out, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average, hvd.Max])
@pytest.mark.parametrize("rows", [1, 7, 2 * 4 + 1])
def test_reducescatter(dtype, op, rows):
    key = ("rs", dtype, int(op), rows)
    x = make(RANK, (rows, 3), dtype, key)
    got = hvd.reducescatter(x, op=op, name=f"rs.{dtype}.{op.name}.{rows}")
    full = reference(op, [make(r, (rows, 3), dtype, key) for r in range(SIZE)], dtype)
    base, extra = divmod(rows, SIZE)
    start = RANK * base + min(RANK, extra)
    mine = base + (1 if RANK < extra else 0)
    assert_close(got, full[start:start + mine], dtype)


@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average])
def test_float16_scale_factors_round_as_horovod(op):
    # Horovod scales a float16 buffer in float32 after the reduced sum is rounded to
    # float16: fp16(f32(postscale) * f32(fp16(sum))), bit for bit.
    rows = 4 * SIZE + 1
    inputs, total = rounding_sums((rows, 3), SIZE, 7)
    post = 0.7391
    factor = np.float32(post / SIZE if op == hvd.Average else post)
    want = (factor * (2 * total).astype(np.float16).astype(np.float32)).astype(np.float16)
    got = hvd.allreduce(inputs[RANK], op=op, name=f"f16scale.{op.name}", prescale_factor=2.0,
                        postscale_factor=post)
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
    base, extra = divmod(rows, SIZE)
    start = RANK * base + min(RANK, extra)
    got = hvd.reducescatter(inputs[RANK], op=op, name=f"f16scale.rs.{op.name}",
                            prescale_factor=2.0, postscale_factor=post)
    assert np.array_equal(got.view(np.uint16),
                          want[start:start + base + (RANK < extra)].view(np.uint16))


def test_grouped_allgather_and_reducescatter():
    # Members of different dtypes and row counts (uneven per rank for allgather),
    # against the concatenation / the reduced parts of each rank's known inputs.
    def parts(r):
        return [make(r, ((r + i) % 3, 2), dtype, ("gag", i)) for i, dtype in
                enumerate(["float32", "int64", "bfloat16"])]

    handle = hvd.grouped_allgather_async(parts(RANK), name="gag")
    got = hvd.synchronize(handle)
    # every rank's first dimension, per member (what the TensorFlow gradient slices by)
    assert handle.first_dims == [tuple((r + i) % 3 for r in range(SIZE)) for i in range(3)]
    for i, g in enumerate(got):
        want = np.concatenate([parts(r)[i] for r in range(SIZE)])
        assert g.dtype == want.dtype and g.shape == want.shape
        assert np.array_equal(g.astype(np.float64), want.astype(np.float64))

    shapes = [(5, 2), (SIZE, 1), (1,)]
    arrays = [make(RANK, s, "float64", ("grs", i)) for i, s in enumerate(shapes)]
    handle = hvd.grouped_reducescatter_async(arrays, op=hvd.Average, name="grs")
    for i, (g, s) in enumerate(zip(hvd.synchronize(handle), shapes)):
        full = reference(hvd.Average, [make(r, s, "float64", ("grs", i)) for r in range(SIZE)], "float64")
        base, extra = divmod(s[0], SIZE)
        start = RANK * base + min(RANK, extra)
        assert_close(g, full[start:start + base + (1 if RANK < extra else 0)], "float64")
    assert hvd.grouped_allgather([], name="empty") == []


def test_barrier_and_join():
    hvd.barrier()
    # Rank r does r extra allreduces before joining; joined ranks contribute zeros.
    for step in range(RANK):
        got = hvd.allreduce(np.ones(4, np.float32), op=hvd.Sum, name=f"join.step{step}")
        active = len([r for r in range(SIZE) if r > step])
        np.testing.assert_allclose(got, np.full(4, active))
    last = hvd.join()
    assert last == SIZE - 1 if SIZE > 1 else last == 0
    np.testing.assert_allclose(hvd.allreduce(np.ones(2), op=hvd.Sum, name="after.join"), np.full(2, SIZE))


def test_many_small_tensors_async():
    handles = [hvd.allreduce_async(np.full(256, i + RANK, np.float32), op=hvd.Sum, name=f"small.{i}")
               for i in range(200)]
    for i, h in enumerate(handles):
        np.testing.assert_allclose(h.result(), np.full(256, sum(i + r for r in range(SIZE))))


def test_negotiation_longer_than_a_mailbox():
    # 300 new names of ~100 characters at once: the requests to rank 0 and its responses
    # run to tens of KB, more than one round of the control board carries (MAILBOX_BYTES),
    # so on one host they go in several rounds; each rank submits in its own order.
    names = [f"negotiation.{'x' * 90}.{i:04d}" for i in range(300)]
    order = list(range(len(names)))
    np.random.RandomState(RANK).shuffle(order)
    handles = {i: hvd.allreduce_async(np.full(2, float(RANK * i), np.float32), op=hvd.Sum,
                                      name=names[i]) for i in order}
    for i in range(len(names)):
        np.testing.assert_array_equal(hvd.synchronize(handles[i]),
                                      np.full(2, float(sum(r * i for r in range(SIZE)))))


@pytest.mark.parametrize("late_ms", [0, 5, 50])
def test_a_late_rank_with_small_and_large_tensors_in_one_step(late_ms):
    # The last rank submits late_ms after the others, which wait for it (on one host in
    # the control board's futex, then in the shared-memory allreduce's); each step mixes
    # one element to several blocks, in an order that differs per rank, and a group. The
    # first step negotiates its names, the second finds them in the response cache.
    import time
    sizes = [1, 1024, 10 * 1024, 70 * 1024, (1 << 20) // 4 * 3 + 5]  # float32 elements
    for step in range(2):
        hvd.barrier()
        if RANK == SIZE - 1 and SIZE > 1:
            time.sleep(late_ms / 1e3)
        order = list(range(len(sizes)))
        np.random.RandomState(RANK + 10 * step).shuffle(order)
        handles = {i: hvd.allreduce_async(make(RANK, (sizes[i],), "float32", ("late", i, step)),
                                          op=hvd.Sum, name=f"late.{late_ms}.{i}") for i in order}
        group = hvd.grouped_allreduce([make(RANK, (n,), "float32", ("lateg", n, step))
                                       for n in (3, 1024, 5000)], op=hvd.Sum,
                                      name=f"lateg.{late_ms}")
        for i, n in enumerate(sizes):
            assert_close(hvd.synchronize(handles[i]), reference(
                hvd.Sum, [make(r, (n,), "float32", ("late", i, step)) for r in range(SIZE)],
                "float32"), "float32")
        for g, n in zip(group, (3, 1024, 5000)):
            assert_close(g, reference(hvd.Sum, [make(r, (n,), "float32", ("lateg", n, step))
                                                for r in range(SIZE)], "float32"), "float32")


def test_topology():
    # The reference: every rank's host from its known identity (pretend_hosts.py), not
    # horolite's allgather.
    expect = expected_topology(RANK)
    got = {"local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
           "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(),
           "is_homogeneous": hvd.is_homogeneous()}
    assert got == {k: expect[k] for k in got}, (got, expect["hosts"])
    if hvd.is_homogeneous():
        assert hvd.cross_size() * hvd.local_size() == SIZE
    assert isinstance(hvd.mpi_threads_supported(), bool)
    hvd.init()  # idempotent
    assert hvd.rank() == RANK


def test_grouped_allreduce_mixed_dtypes_and_repeat():
    arrays = [np.full(3, RANK, np.float32), np.full((2, 2), RANK, np.int64)]
    for _ in range(3):  # the second and third go through the response cache
        f, i = hvd.grouped_allreduce(arrays, op=hvd.Sum, name="group.mixed")
        assert f.dtype == np.float32 and i.dtype == np.int64 and i.shape == (2, 2)
        assert (f == sum(range(SIZE))).all() and (i == sum(range(SIZE))).all()
    for _ in range(3):
        a, b = hvd.grouped_allreduce([np.full(5, 1.0 + RANK), np.full((1, 2), 2.0)], name="group.same")
        np.testing.assert_allclose(a, np.full(5, 1 + (SIZE - 1) / 2))
        np.testing.assert_allclose(b, np.full((1, 2), 2.0))


def test_large_grouped_allreduce_members_aligned_and_buffers_reused_safely():
    # Members of odd sizes (a bias of 10 floats, 3 bytes of int8...) are padded so every
    # result starts on a 64-byte boundary (TensorFlow copies unaligned NumPy results);
    # the padding must not leak into any result, and the packing buffers are reused
    # (>= 64 KiB) only once nothing refers to them.
    shapes = [(10,), (300, 129), (7,), (33, 3, 3), (40_001,)]
    for dtype in ("float32", "float64", "int8", "float16"):
        arrays = [make(RANK, s, dtype, ("big", dtype, i)) for i, s in enumerate(shapes)]
        want = [reference(hvd.Sum, [make(r, s, dtype, ("big", dtype, i)) for r in range(SIZE)], dtype)
                for i, s in enumerate(shapes)]
        held = []
        for step in range(3):  # the later steps reuse the packing and result buffers
            got = hvd.grouped_allreduce(arrays, op=hvd.Sum, name=f"group.big.{dtype}")
            assert [g.shape for g in got] == shapes
            for g, w in zip(got, want):
                assert g.ctypes.data % 64 == 0, (dtype, g.shape, g.ctypes.data % 64)
                assert_close(g, w, dtype)
            held.append(got[1])  # a view keeps its result buffer out of the pool
        for h in held:
            assert_close(h, want[1], dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_large_group_members_are_read_where_they_lie(dtype):
    # A group of 4 MiB or more is reduced straight into the result buffer: through shared
    # memory its members (odd sizes, padding between them, a strided one) are read where
    # they lie ("direct": not packed first); elsewhere packed. Also fused with other
    # tensors, scaled (packed), and the members are left as they were.
    from horolite.api.basics import runtime
    from horolite.api.grouping import IN_PLACE_MIN_BYTES
    itemsize = np.dtype(np_dtype(dtype)).itemsize
    big = IN_PLACE_MIN_BYTES // itemsize
    shapes = [(10,), (big // 3, 3), (7,), (2 * 9_999,), (big // 4,)]
    key = ("read", dtype)
    mine = [make(RANK, s, dtype, key + (i,)) for i, s in enumerate(shapes)]
    mine[3] = mine[3][::2]  # strided: copied first
    theirs = [[make(r, s, dtype, key + (i,)) for i, s in enumerate(shapes)] for r in range(SIZE)]
    want = [reference(hvd.Sum, [t[i] if i != 3 else t[i][::2] for t in theirs], dtype)
            for i in range(len(shapes))]
    before = [m.copy() for m in mine]
    shm = runtime().transport.shared_memory
    for step in range(2):
        got = hvd.grouped_allreduce(mine, op=hvd.Sum, name=f"group.read.{dtype}")
        for g, w in zip(got, want):
            assert_close(g, w, dtype)
        if shm is not None:
            assert shm.last_mode == "direct", shm.last_mode
    # submitted with a single tensor: fused with it when both reach the same cycle, as
    # they mostly do (the group's parts are then the batch's input)
    lone = make(RANK, (1000,), dtype, key + ("lone",))
    handles = [hvd.grouped_allreduce_async(mine, op=hvd.Sum, name=f"group.read.{dtype}"),
               hvd.allreduce_async(lone, op=hvd.Sum, name=f"group.read.lone.{dtype}")]
    got, lone_sum = hvd.synchronize(handles[0]), hvd.synchronize(handles[1])
    for g, w in zip(got, want):
        assert_close(g, w, dtype)
    assert_close(lone_sum, reference(hvd.Sum, [make(r, (1000,), dtype, key + ("lone",))
                                               for r in range(SIZE)], dtype), dtype)
    scaled = hvd.grouped_allreduce(mine, op=hvd.Sum, prescale_factor=0.5,
                                   name=f"group.read.scaled.{dtype}")
    assert_close(scaled[1], reference(hvd.Sum, [t[1] for t in theirs], dtype) * 0.5, dtype)
    assert all(np.array_equal(m, b) for m, b in zip(mine, before)), "a member was modified"


@pytest.mark.parametrize("dtype", ["float32", "int64", "bfloat16"])
def test_grouped_allreduce_of_flat_members_with_padding_and_a_strided_one(dtype):
    # All members 1-d (packed by NumPy's concatenate), odd sizes (padding in between),
    # one of them a strided view; small and pooled totals.
    for n_big in (5, 70_000):
        base = make(RANK, (2 * n_big,), dtype, ("flat", dtype, n_big, "s"))
        arrays = [make(RANK, (n,), dtype, ("flat", dtype, n_big, i)) for i, n in
                  enumerate([10, 1, 33])] + [base[::2], make(RANK, (n_big,), dtype, ("flat", dtype, n_big, 9))]
        got = hvd.grouped_allreduce(arrays, op=hvd.Sum, name=f"group.flat.{dtype}.{n_big}")
        for i, n in enumerate([10, 1, 33]):
            assert_close(got[i], reference(hvd.Sum, [make(r, (n,), dtype, ("flat", dtype, n_big, i))
                                                     for r in range(SIZE)], dtype), dtype)
        assert_close(got[3], reference(hvd.Sum, [make(r, (2 * n_big,), dtype, ("flat", dtype, n_big, "s"))[::2]
                                                 for r in range(SIZE)], dtype), dtype)
        assert_close(got[4], reference(hvd.Sum, [make(r, (n_big,), dtype, ("flat", dtype, n_big, 9))
                                                 for r in range(SIZE)], dtype), dtype)


def test_large_results_are_never_reused_while_anything_holds_them():
    # Results of >= 64 KiB come from a pool; one still referenced (even through a view) must
    # never be handed out again.
    total = sum(range(1, SIZE + 1))
    x = np.full(300_000, RANK + 1.0, np.float32)
    first = hvd.allreduce(x, op=hvd.Sum, name="pool")
    kept = hvd.allreduce(x, op=hvd.Sum, name="pool")
    view = first[:10]
    del first
    results = [hvd.allreduce(x * k, op=hvd.Sum, name="pool") for k in (2, 3, 4)]
    assert (view == total).all() and (kept == total).all()
    for k, r in zip((2, 3, 4), results):
        assert (r == k * total).all()
    del results
    again = hvd.allreduce(x * 5, op=hvd.Sum, name="pool")  # may reuse a dropped one
    assert (again == 5 * total).all() and (view == total).all() and (kept == total).all()


def test_fused_results_stay_valid_while_any_is_held():
    # A fused batch's results are views of one pooled array: holding one result must keep
    # that array from being reused by later steps.
    total = sum(range(1, SIZE + 1))

    def step(k):
        handles = [hvd.allreduce_async(np.full(20_000, (RANK + 1.0) * k * (i + 1), np.float32),
                                       op=hvd.Sum, name=f"fusedpool.{i}") for i in range(4)]
        return [hvd.synchronize(h) for h in handles]

    kept = step(1)[2]
    later = [step(k) for k in (2, 3, 4)]
    assert (kept == total * 3).all()
    for k, results in zip((2, 3, 4), later):
        for i, r in enumerate(results):
            assert (r == total * k * (i + 1)).all(), (k, i)


@pytest.mark.parametrize("dtype", ["float32", "int32", "float16", "bfloat16"])
def test_fused_async_step_of_mixed_shapes_repeated(dtype):
    # One step of async allreduces that fuse into one batch: shapes of every kind
    # (scalar, empty, flat, 2-d, 3-d), repeated so later steps come from the response
    # cache; with and without a prescale factor (two ways of packing); every step's
    # results held to the end (they are views of pooled buffers).
    shapes = [(), (0,), (7,), (3, 5), (2, 2, 3), (1,), (1031,), (3, 5)]
    held = []
    for step in range(4):
        pre = 2.0 if step % 2 else 1.0
        arrays = [make(RANK, s, dtype, ("mixed", dtype, step, i)) for i, s in enumerate(shapes)]
        handles = [hvd.allreduce_async(a, op=hvd.Sum, name=f"mixed.{dtype}.{i}", prescale_factor=pre)
                   for i, a in enumerate(arrays)]
        got = [hvd.synchronize(h) for h in handles]
        want = [pre * reference(hvd.Sum, [make(r, s, dtype, ("mixed", dtype, step, i))
                                          for r in range(SIZE)], dtype) for i, s in enumerate(shapes)]
        for g, w in zip(got, want):
            assert isinstance(g, np.ndarray) and g.dtype == np_dtype(dtype)
            assert_close(g, w, dtype)
        held.append((got, want))
    for got, want in held:
        for g, w in zip(got, want):
            assert_close(g, w, dtype)


def test_fused_async_step_of_one_multidim_shape_repeated():
    # Members of one 2-d shape: the results are the rows of one reshape of the buffer.
    for step in range(3):
        handles = [hvd.allreduce_async(np.full((4, 6), (RANK + 1.0) * (i + step), np.float64),
                                       op=hvd.Average, name=f"rows.{i}") for i in range(50)]
        for i, h in enumerate(handles):
            got = hvd.synchronize(h)
            assert got.shape == (4, 6)
            np.testing.assert_allclose(got, np.full((4, 6), (i + step) * (SIZE + 1) / 2))


def test_fused_async_allreduces_while_ranks_join():
    # Rank r submits r + 1 steps of small allreduces that fuse, then joins: the ranks
    # that have joined add zeros to the others' fused batches.
    hvd.barrier()
    for step in range(RANK + 1):
        handles = [hvd.allreduce_async(np.full(5 + i, 1.0 + i, np.float32), op=hvd.Sum,
                                       name=f"joinfused.{step}.{i}") for i in range(6)]
        active = len([r for r in range(SIZE) if r >= step])
        for i, h in enumerate(handles):
            np.testing.assert_allclose(hvd.synchronize(h), np.full(5 + i, (1.0 + i) * active))
    assert hvd.join() == SIZE - 1
    np.testing.assert_allclose(hvd.allreduce(np.ones(3), op=hvd.Sum, name="after.joinfused"),
                               np.full(3, SIZE))


def setting(name, default):
    """A setting as the matrix driver set it in the environment (either prefix)."""
    return os.environ.get("HOROLITE_" + name, os.environ.get("HOROVOD_" + name, default))


def test_the_jobs_settings_took_effect():
    # The matrix variants (tests/test_matrix_core.py) differ only by environment: check the
    # runtime did as told, from what it did (paths taken, batches fused, slots evicted).
    from horolite.api.basics import runtime
    rt = runtime()
    paths, fused, evicted = dict(rt.transport.paths), rt.executor.fused_batches, rt.cache.evictions
    members = 12  # more names than the smallest cache variant (7 slots) holds
    for step in range(2):
        # (two dtypes: the group goes as separate tensors submitted together, which fuse)
        arrays = [np.full(10, RANK + i + step, np.float32 if i < members // 2 else np.float64)
                  for i in range(members)]
        got = hvd.grouped_allreduce(arrays, op=hvd.Sum, name=f"effect.{step}")
        for i, g in enumerate(got):
            np.testing.assert_array_equal(g, np.full(10, sum(r + i + step for r in range(SIZE))))
        for i in range(members):
            h = hvd.allreduce_async(np.full(3, RANK + i, np.float64), op=hvd.Sum, name=f"eff.{i}")
            np.testing.assert_array_equal(hvd.synchronize(h), np.full(3, sum(r + i for r in range(SIZE))))
    paths = {k: rt.transport.paths[k] - v for k, v in paths.items()}
    fused, evicted = rt.executor.fused_batches - fused, rt.cache.evictions - evicted
    board = rt.transport.board  # the control exchange in shared memory (control_board.py)

    hosts = expected_topology(RANK)["hosts"]
    shared = SIZE > 1 and len(hosts) == 1 and setting("SHARED_MEMORY", "1") not in ("0", "false")
    if SIZE > 1:
        used = {k for k in ("shared_memory", "hierarchical", "ring") if paths[k]}
        want = ("shared_memory" if shared else
                "hierarchical" if hierarchical_applies() and
                setting("HIERARCHICAL_ALLREDUCE", "1") not in ("0", "false") else "ring")
        assert used == {want}, paths
        # With shared memory the control exchange went through the board; across hosts,
        # where some host holds two ranks, through each host's board and one rank per host
        # (host_control.py); else over MPI between every rank.
        assert (board is not None and board.rounds > 0) if shared else board is None
        control = rt.transport.host_control
        across = (not shared and len(hosts) > 1 and max(hosts) > 1
                  and setting("SHARED_MEMORY", "1") not in ("0", "false"))
        assert (control is not None) == across
        if across and control.board is not None:
            assert control.board.rounds > 0
    threshold = int(setting("FUSION_THRESHOLD", str(128 << 20)))
    if threshold == 0:  # every tensor alone: 2 x (12 grouped + 12 single) allreduces
        assert fused == 0
        if SIZE > 1:
            assert sum(paths[k] for k in ("shared_memory", "hierarchical", "ring")) == 4 * members
    else:  # each dtype's 6 members of a group fit any threshold here: fused at least once a step
        assert fused >= 2, fused
    capacity = int(setting("CACHE_CAPACITY", "1024"))
    if capacity == 0:
        assert len(rt.cache) == 0 and evicted == 0
    elif capacity < 2 * members:  # the 24 names of a step cannot all stay
        assert evicted > 0 and len(rt.cache) == capacity
    else:
        assert len(rt.cache) >= 2 * members


def test_broadcast_object_gives_every_rank_the_roots_object():
    for root in {0, SIZE - 1}:
        mine = {"rank": RANK, "payload": list(range(RANK + 2)), "text": "é" * RANK}
        got = hvd.broadcast_object(mine, root_rank=root, name=f"obj.{root}")
        assert got == {"rank": root, "payload": list(range(root + 2)), "text": "é" * root}
