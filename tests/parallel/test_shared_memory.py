"""The shared-memory allreduce (transport/shared_memory.py, native/shm_ring.c)
on a real shared window between real ranks, against NumPy references.

Sizes straddle the slot size (one block per slot), so blocks, uneven segments
and the slot reuse across calls are all exercised; one instance serves every
test in order, so its progress counters run on across dtypes of different
item sizes.
"""
import logging
import time
import zlib

import numpy as np
import pytest
from mpi4py import MPI

from horolite.ops import ReduceOp
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
    return sorted({1, 2, 5, max(SIZE - 1, 1), per_slot - 1, per_slot, per_slot + 1,
                   3 * per_slot + 13})


@pytest.fixture(scope="module")
def shm():
    instance = shm_mod.open_shared_memory(COMM, polite=SIZE > 2, report_after=60.0)
    yield instance
    if instance is not None:
        instance.close()


def test_open_only_with_peers_and_when_enabled(shm):
    assert (shm is None) == (SIZE == 1)
    assert shm_mod.open_shared_memory(COMM, polite=True, report_after=1.0, enabled=False) is None


@needs_ranks
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_numpy(shm, dtype, op):
    high = 3 if op == ReduceOp.PRODUCT else 5  # products stay inside int8
    postscale = 1.0 / SIZE if op == ReduceOp.AVERAGE else 1.0
    for count in sizes(dtype):
        key = (dtype, op.name, count)
        inputs = [make(q, count, dtype, key, high) for q in range(SIZE)]
        src = inputs[RANK].copy()
        dst = np.full(count, 99, dtype=src.dtype)
        shm.allreduce(src, dst, op, postscale, what=f"tensor 't{count}'")
        assert np.array_equal(src, inputs[RANK]), "the input was modified"
        want = reference(op, inputs, dtype)
        got = dst.astype(np.float64)
        if dtype in ("float16", "bfloat16"):
            np.testing.assert_allclose(got, want, rtol=2e-2, atol=1e-2)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=0, err_msg=f"{count} elements")


@needs_ranks
def test_in_place_with_postscale(shm):
    count = 2 * (shm_mod.SLOT_BYTES // 4) + 7
    inputs = [make(q, count, "float32", "inplace", 100) for q in range(SIZE)]
    buf = inputs[RANK].copy()
    shm.allreduce(buf, buf, ReduceOp.SUM, 0.25)
    np.testing.assert_allclose(buf, np.sum(inputs, axis=0) * 0.25, rtol=1e-6)


@needs_ranks
def test_result_identical_on_every_rank(shm):
    # Each segment is reduced once, by its owner: every rank gets the same bits,
    # even for a sum whose rounding depends on the order.
    count = shm_mod.SLOT_BYTES // 4 * 2 + 3
    x = (np.random.RandomState(RANK).standard_normal(count) * 10.0 ** (RANK % 5)).astype(np.float32)
    out = np.empty_like(x)
    shm.allreduce(x, out, ReduceOp.SUM, 1.0)
    everyone = COMM.allgather(out.tobytes())
    assert all(b == everyone[0] for b in everyone)


@needs_ranks
def test_a_late_rank_is_reported_and_then_joins():
    late = SIZE - 1
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("horolite.transport.shared_memory")
    logger.addHandler(handler)
    instance = shm_mod.SharedMemoryAllreduce(COMM, polite=True, report_after=0.3)
    try:
        x = np.full(1000, RANK + 1, dtype=np.float64)
        out = np.empty_like(x)
        if RANK == late:
            time.sleep(1.2)
        instance.allreduce(x, out, ReduceOp.SUM, 1.0, what="tensor 'grad/late'")
        assert np.all(out == SIZE * (SIZE + 1) / 2)
    finally:
        logger.removeHandler(handler)
        instance.close()
    messages = [r.getMessage() for r in records]
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
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("horolite.transport.shared_memory")
    logger.addHandler(handler)
    try:
        assert shm_mod.open_shared_memory(COMM, polite=True, report_after=1.0) is None
    finally:
        logger.removeHandler(handler)
    assert any("uses the ring over MPI" in r.getMessage() for r in records)


def test_runtime_uses_it_when_all_ranks_share_the_host():
    import horolite as hvd
    from horolite import basics
    hvd.init()
    try:
        assert (basics._runtime.transport.shared_memory is not None) == (SIZE > 1)
        x = np.arange(300000, dtype=np.float32) + RANK
        y = hvd.allreduce(x, op=hvd.Sum, name="runtime.big")
        np.testing.assert_allclose(y, SIZE * np.arange(300000) + SIZE * (SIZE - 1) / 2, rtol=1e-6)
    finally:
        hvd.shutdown()
