"""The shared-memory allreduce (transport/shared_memory.py, native/shm_ring.c)
on a real shared window between real ranks, against NumPy references.

Every result is checked three ways: into private memory (each rank copies the
reduced blocks out: mode "gather"), into the result arena
(transport/result_arena.py: the reducing rank writes every rank's result,
"direct"), and in place in the arena (the reducing rank also reads every
rank's buffer directly, "shared").

Sizes straddle the slot size (one block per slot), so blocks, uneven segments
and the slot reuse across calls are all exercised; one instance serves every
test in order, so its progress counters run on across dtypes of different
item sizes.
"""
import contextlib
import logging
import time
import zlib

import numpy as np
import pytest
from horolite.core.mpi_library import MPI  # the job world's: mpi4py's under mpirun

from horolite.core.ops import ReduceOp
from horolite.transport import result_arena
from horolite.transport import shared_memory as shm_mod
from test_collectives import np_dtype, reference  # (starts the runtime: harmless here)

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
DTYPES = ["uint8", "int8", "int32", "int64", "float16", "bfloat16", "float32", "float64"]
OPS = [ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT]
needs_ranks = pytest.mark.skipif(SIZE < 2, reason="one rank has nobody to share memory with")


def make(rank, count, dtype, key, high):
    """Values in [low, high), different per rank, key and position (cheaper than an RNG)."""
    low = 1 if high == 3 else 0
    salt = zlib.crc32(repr((rank, key)).encode()) % 9973
    values = (np.arange(count, dtype=np.int64) * (2 * rank + 3) + salt) % (high - low) + low
    return values.astype(np_dtype(dtype))


def sizes(dtype):
    per_slot = shm_mod.SLOT_BYTES // np_dtype(dtype).itemsize
    one_shot = shm_mod.ONE_SHOT_BYTES // np_dtype(dtype).itemsize  # the largest in one shot
    return sorted({1, 2, 5, max(SIZE - 1, 1), one_shot, one_shot + 1, per_slot - 1, per_slot,
                   per_slot + 1, 3 * per_slot + 13})


@pytest.fixture(scope="module")
def shm():
    instance = shm_mod.open_shared_memory(COMM, polite=SIZE > 2, report_after=60.0)
    yield instance
    if instance is not None:
        instance.close()


@contextlib.contextmanager
def logged(name, level=None):
    """The messages logger `name` emits inside the block (level: let INFO through)."""
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger(name)
    old_level = logger.level
    logger.addHandler(handler)
    if level is not None:
        logger.setLevel(level)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def output(shm, where, count, dtype):
    """A result array of `count` elements filled with junk, private or in the arena."""
    if where == "private":
        out = np.empty(count, dtype=dtype)
    else:
        out = shm.arena.empty((count,), np.dtype(dtype))
        assert out is not None
    out.view(np.uint8)[:] = 99
    return out


def test_open_only_with_peers_and_when_enabled(shm):
    assert (shm is None) == (SIZE == 1)
    assert shm is None or shm.arena is not None
    assert shm_mod.open_shared_memory(COMM, polite=True, report_after=1.0, enabled=False) is None


MODES = {"private": "gather", "arena": "direct", "arena-in-place": "shared"}


def reduce_where(shm, where, mine, op, postscale, what):
    """(src, dst) after reducing this rank's `mine` with the result where `where`
    says (MODES), checking the mode the call took."""
    dst = output(shm, where, mine.size, mine.dtype)
    if where == "arena-in-place":
        dst[:] = mine
        src = dst
    else:
        src = mine.copy()
    shm.allreduce(src, dst, op, postscale, what=what)
    assert shm.last_mode == ("one-shot" if mine.nbytes <= shm_mod.ONE_SHOT_BYTES
                             else MODES[where])
    return src, dst


@needs_ranks
@pytest.mark.parametrize("where", list(MODES))
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_numpy(shm, dtype, op, where):
    high = 3 if op == ReduceOp.PRODUCT else 5  # products stay inside int8
    postscale = 1.0 / SIZE if op == ReduceOp.AVERAGE else 1.0
    for count in sizes(dtype):
        key = (dtype, op.name, count)
        inputs = [make(q, count, dtype, key, high) for q in range(SIZE)]
        src, dst = reduce_where(shm, where, inputs[RANK], op, postscale, f"tensor 't{count}'")
        assert src is dst or np.array_equal(src, inputs[RANK]), "the input was modified"
        want = reference(op, inputs, dtype)
        got = dst.astype(np.float64)
        if dtype in ("float16", "bfloat16"):
            np.testing.assert_allclose(got, want, rtol=2e-2, atol=1e-2)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=0, err_msg=f"{count} elements")


@needs_ranks
@pytest.mark.parametrize("where", ["private", "arena"])  # in the arena: "shared"
def test_in_place_with_postscale(shm, where):
    count = 2 * (shm_mod.SLOT_BYTES // 4) + 7
    inputs = [make(q, count, "float32", "inplace", 100) for q in range(SIZE)]
    buf = output(shm, where, count, np.float32)
    buf[:] = inputs[RANK]
    shm.allreduce(buf, buf, ReduceOp.SUM, 0.25)
    np.testing.assert_allclose(buf, np.sum(inputs, axis=0) * 0.25, rtol=1e-6)


@needs_ranks
@pytest.mark.parametrize("where", list(MODES))
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVERAGE], ids=lambda o: o.name)
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16", "int32"])
def test_large_results_stream_into_every_rank(shm, dtype, op, where):
    # From 8 MiB (HL_STREAM_BYTES) results are written with streaming stores; a
    # float sum there is one pass that adds and writes every rank's result
    # (hl_sum_to_all) for float32/float64. The odd count puts segment starts off
    # 16-byte boundaries for 3 ranks; float16, bfloat16 and int32 keep the
    # reduce-then-copy path. Values are integers small enough for every dtype,
    # so the sum is exact whatever the order; an average is checked to the
    # dtype's rounding.
    itemsize = np.dtype(np_dtype(dtype)).itemsize
    count = (8 << 20) // itemsize + 3 * (shm_mod.SLOT_BYTES // itemsize) // 2 + 11
    postscale = 1.0 / SIZE if op == ReduceOp.AVERAGE else 1.0
    high = 50 if itemsize == 2 else 1000  # sums of 4 ranks exact in bfloat16's 8 bits
    inputs = [make(q, count, dtype, ("large", op.name), high) for q in range(SIZE)]
    _, dst = reduce_where(shm, where, inputs[RANK], op, postscale, "tensor 'large'")
    want = reference(op, inputs, dtype)
    if op == ReduceOp.SUM or dtype == "int32":
        np.testing.assert_array_equal(dst.astype(np.float64), want)
    else:
        rtol = {"float16": 1e-3, "bfloat16": 8e-3}.get(dtype, 1e-6)  # half an ulp and a bit
        np.testing.assert_allclose(dst.astype(np.float64), want, rtol=rtol, atol=0)
    everyone = COMM.allgather(zlib.crc32(dst.tobytes()))
    assert len(set(everyone)) == 1, everyone


def split_at_odd_places(array, rank):
    """`array` as a list of views: empty parts, one-element parts, parts across a 16 KiB
    chunk and a slot boundary, and a long tail; the cuts differ from rank to rank."""
    per_slot = shm_mod.SLOT_BYTES // array.itemsize
    chunk = 16384 // array.itemsize
    cuts = sorted({c for c in (0, 0, 1, 2, 3 + rank, chunk - 1 - rank, chunk + 5, chunk + 5,
                               per_slot - 2 * rank - 1, per_slot + 3, 2 * per_slot + rank)
                   if c <= array.size} | {array.size})
    edges = [0] + cuts + [array.size]
    return [array[a:b] for a, b in zip(edges, edges[1:])] + [array[array.size:]]


@needs_ranks
@pytest.mark.parametrize("where", ["private", "arena"])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MAX], ids=lambda o: o.name)
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int32"])
def test_members_are_read_where_they_lie(shm, dtype, op, where):
    # A fused batch's members go in as a list (no pack first): the concatenation is
    # reduced, whatever the cuts, and the members are left as they were. Large enough
    # for streaming stores (8 MiB) in float32, across several slots otherwise.
    itemsize = np.dtype(np_dtype(dtype)).itemsize
    per_slot = shm_mod.SLOT_BYTES // itemsize
    for count in (2 * per_slot + 13, ((9 << 20) // itemsize) if dtype == "float32" else 7):
        postscale = 1.0 / SIZE if op == ReduceOp.AVERAGE else 1.0
        inputs = [make(q, count, dtype, ("parts", op.name, count), 50) for q in range(SIZE)]
        parts = split_at_odd_places(inputs[RANK].copy(), RANK)
        before = [p.copy() for p in parts]
        dst = output(shm, where, count, inputs[RANK].dtype)
        shm.allreduce(parts, dst, op, postscale, what="tensor 'parts'")
        assert shm.last_mode == ("one-shot" if count * itemsize <= shm_mod.ONE_SHOT_BYTES
                                 else MODES[where])
        assert all(np.array_equal(p, b) for p, b in zip(parts, before)), "a member was modified"
        want = reference(op, inputs, dtype)
        if op == ReduceOp.AVERAGE and dtype == "float16":
            np.testing.assert_allclose(dst.astype(np.float64), want, rtol=1e-3)
        else:
            np.testing.assert_allclose(dst.astype(np.float64), want, rtol=1e-7, atol=0,
                                       err_msg=f"{count} elements")


@needs_ranks
def test_every_rank_chooses_the_mode_the_least_able_rank_allows(shm):
    # Calls switch between the three modes, over more blocks than slots: each mode
    # reuses slots another one left, and every rank must choose the same mode each
    # time: one private result makes all copy out, one rank not in place makes all
    # direct. (odd: the rank whose result is private; even: the rank not in place)
    count = (shm_mod.SLOTS + 2) * (shm_mod.SLOT_BYTES // 8) + 5
    plan = [(None, None, "shared"), (SIZE - 1, None, "gather"), (None, None, "shared"),
            (None, 0, "direct"), (0, 0, "gather"), (None, SIZE - 1, "direct"),
            (None, None, "shared"), (None, 0, "direct"), (0, None, "gather")]
    for call, (private_rank, copying_rank, mode) in enumerate(plan):
        inputs = [make(q, count, "float64", ("mixed", call), 50) for q in range(SIZE)]
        where = "private" if RANK == private_rank else "arena"
        dst = output(shm, where, count, np.float64)
        if RANK == copying_rank or RANK == private_rank:
            src = inputs[RANK]
        else:
            dst[:] = inputs[RANK]
            src = dst
        shm.allreduce(src, dst, ReduceOp.SUM, 1.0, what=f"tensor 'mixed{call}'")
        np.testing.assert_array_equal(dst, np.sum(inputs, axis=0), err_msg=f"call {call}")
        assert shm.last_mode == mode, (call, shm.last_mode)


@needs_ranks
@pytest.mark.parametrize("where", ["private", "arena"])
@pytest.mark.parametrize("blocks", ["one-shot", "blocks"])
def test_result_identical_on_every_rank(shm, where, blocks):
    # Each segment is reduced once, by its owner (in one shot: by every rank, in rank
    # order): every rank gets the same bits, even for a sum whose rounding depends on
    # the order.
    count = shm_mod.ONE_SHOT_BYTES // 4 - 3 if blocks == "one-shot" else shm_mod.SLOT_BYTES // 4 * 2 + 3
    x = (np.random.RandomState(RANK).standard_normal(count) * 10.0 ** (RANK % 5)).astype(np.float32)
    out = output(shm, where, count, np.float32)
    shm.allreduce(x, out, ReduceOp.SUM, 1.0)
    everyone = COMM.allgather(out.tobytes())
    assert all(b == everyone[0] for b in everyone)


@needs_ranks
@pytest.mark.parametrize("where", ["private", "arena"])
def test_a_late_rank_is_reported_and_then_joins(where):
    late = SIZE - 1
    instance = shm_mod.open_shared_memory(COMM, polite=True, report_after=0.3,
                                          arena=where == "arena")
    try:
        x = np.full(1000, RANK + 1, dtype=np.float64)
        out = output(instance, where, x.size, x.dtype)
        if RANK == late:
            time.sleep(1.2)
        with logged("horolite.transport.shared_memory") as messages:
            instance.allreduce(x, out, ReduceOp.SUM, 1.0, what="tensor 'grad/late'")
        assert np.all(out == SIZE * (SIZE + 1) / 2)
    finally:
        instance.close()
    if RANK == late:
        assert messages == []
    else:
        assert messages, "the wait for the late rank was not reported"
        assert f"rank {RANK}: tensor 'grad/late' has waited" in messages[0] and f"for ranks [{late}]" in messages[0], messages[0]


@needs_ranks
def test_no_window_falls_back_to_the_ring(monkeypatch):
    # What a container with a tiny /dev/shm does to MPI_Win_allocate_shared, on every rank.
    def refuse(self, *args):
        raise MPI.Exception(MPI.ERR_NO_MEM)
    monkeypatch.setattr(shm_mod.SharedMemoryAllreduce, "__init__", refuse)
    with logged("horolite.transport.shared_memory") as messages:
        assert shm_mod.open_shared_memory(COMM, polite=True, report_after=1.0) is None
    assert any("uses the ring over MPI" in m for m in messages)


@needs_ranks
def test_an_arena_refused_anywhere_is_used_nowhere(monkeypatch):
    # As where /proc/<pid>/fd of another process cannot be opened (hidepid, another user).
    if RANK == SIZE - 1:
        real = result_arena.ResultArena.map_peers

        def refuse(self, comm):
            real(self, comm)  # the same collectives, then the failure
            raise PermissionError("not allowed to open another rank's arena")
        monkeypatch.setattr(result_arena.ResultArena, "map_peers", refuse)
    # It says so at INFO: a slower path, not a fault.
    with logged("horolite.transport.result_arena", logging.INFO) as messages:
        instance = shm_mod.open_shared_memory(COMM, polite=True, report_after=60.0)
    try:
        assert instance is not None and instance.arena is None
        x = np.full(5000, RANK + 1, dtype=np.int64)
        out = np.empty_like(x)
        instance.allreduce(x, out, ReduceOp.SUM, 1.0)
        assert np.all(out == SIZE * (SIZE + 1) // 2)
    finally:
        instance.close()
    want = "not allowed" if RANK == SIZE - 1 else "another rank could not share its results"
    assert any(want in m for m in messages), messages


def test_runtime_uses_it_when_all_ranks_share_the_host():
    import horolite as hvd
    from horolite.api import basics
    hvd.init()
    try:
        shared = basics.runtime().transport.shared_memory
        assert (shared is not None) == (SIZE > 1)
        x = np.arange(300000, dtype=np.float32) + RANK
        want = SIZE * np.arange(300000) + SIZE * (SIZE - 1) / 2
        y = hvd.allreduce(x, op=hvd.Sum, name="runtime.big")
        np.testing.assert_allclose(y, want, rtol=1e-6)
        if shared is not None:  # the pooled result is in the arena: written directly
            own = np.frombuffer(shared.arena.maps[RANK], np.uint8)
            assert np.shares_memory(y, own)
        # Held results are never handed out again, even while the others write theirs.
        z = hvd.allreduce(x * 2, op=hvd.Sum, name="runtime.big")
        w = hvd.allreduce(x * 3, op=hvd.Sum, name="runtime.big")
        np.testing.assert_allclose(y, want, rtol=1e-6)
        np.testing.assert_allclose(z, 2 * want, rtol=1e-6)
        np.testing.assert_allclose(w, 3 * want, rtol=1e-6)
    finally:
        hvd.shutdown()
