"""Rank side: the exchange lane (horolite/execution/lane.py).

Agreed allreduces run on a thread of their own, while the background thread agrees
the next ones. Run where the lane is on (HOROLITE_EXCHANGE_PIPELINE=1 on this host,
or pretend hosts, where `auto` turns it on): every result is checked against NumPy
from each rank's known inputs, with broadcasts, gathers and errors (which run on the
background thread once the lane is empty) in between.
"""
import time

import numpy as np
import pytest
from mpi4py import MPI

import horolite as hvd
from horolite.errors import TensorMismatchError
from horolite.runtime import registry

hvd.init()
R, N = hvd.rank(), hvd.size()
RT = registry.current()


def lane():
    if N < 2:
        pytest.skip("needs at least two ranks")
    assert RT.lane is not None, "this run should have an exchange lane"
    return RT.lane


def until_handed_over(handle):
    """Wait until the lane runs something, or `handle` is done."""
    deadline = time.monotonic() + 60
    while not RT.lane.running and not hvd.poll(handle) and time.monotonic() < deadline:
        time.sleep(0.0002)


def data(r, i, n, dtype):
    rng = np.random.RandomState(7919 * i + r)
    return rng.uniform(-4, 4, n).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int32, np.int64])
def test_waves_of_allreduces_match_numpy(dtype):
    ln = lane()
    before = ln.lists
    kind = np.dtype(dtype).name
    for wave in range(4):
        # A wave submitted one tensor at a time, with a pause: several agreed lists.
        handles = []
        for i in range(6):
            n = 1000 + 37 * i + 500 * wave
            handles.append((i, n, hvd.allreduce_async(data(R, i + 10 * wave, n, dtype),
                                                      name=f"lane.{kind}.{wave}.{i}",
                                                      op=hvd.Sum)))
            time.sleep(0.002 * (i % 2))
        for i, n, h in handles:
            got = hvd.synchronize(h)
            want = sum(data(r, i + 10 * wave, n, dtype).astype(np.float64) for r in range(N))
            assert got.dtype == dtype and got.shape == (n,)
            tol = {np.float16: 2e-2 * N, np.float32: 1e-5}.get(dtype, 1e-12)
            np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol)
    assert ln.lists > before


def test_averages_and_scales_like_numpy():
    lane()
    got = hvd.allreduce(data(R, 1, 4097, np.float32), name="lane.average", prescale_factor=0.5,
                        postscale_factor=3.0)
    want = 1.5 * np.mean([data(r, 1, 4097, np.float32).astype(np.float64) for r in range(N)],
                         axis=0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    group = hvd.grouped_allreduce([data(R, k, 300 + k, np.float64) for k in range(5)],
                                  name="lane.group", op=hvd.Sum)
    for k, g in enumerate(group):
        np.testing.assert_allclose(g, sum(data(r, k, 300 + k, np.float64) for r in range(N)))


def test_other_collectives_between_allreduces_keep_the_agreed_order():
    ln = lane()
    before = ln.lists
    for rnd in range(5):
        first = hvd.allreduce_async(data(R, rnd, 50_000, np.float32), name=f"lane.mix.a.{rnd}",
                                    op=hvd.Sum)
        until_handed_over(first)  # alone in its list: the lane's; what follows waits for it
        root = rnd % N
        bcast = hvd.broadcast_async(data(R, 100 + rnd, 777, np.float64), root,
                                    name=f"lane.mix.b.{rnd}")
        rows = hvd.allgather_async(np.full((R + 1, 3), R + rnd, np.int32), name=f"lane.mix.g.{rnd}")
        last = hvd.allreduce_async(data(R, 200 + rnd, 3000, np.float64), name=f"lane.mix.c.{rnd}",
                                   op=hvd.Sum)
        np.testing.assert_allclose(
            hvd.synchronize(first),
            sum(data(r, rnd, 50_000, np.float32).astype(np.float64) for r in range(N)),
            rtol=1e-5, atol=1e-4)
        np.testing.assert_array_equal(hvd.synchronize(bcast), data(root, 100 + rnd, 777, np.float64))
        np.testing.assert_array_equal(
            hvd.synchronize(rows),
            np.concatenate([np.full((r + 1, 3), r + rnd, np.int32) for r in range(N)]))
        np.testing.assert_allclose(hvd.synchronize(last),
                                   sum(data(r, 200 + rnd, 3000, np.float64) for r in range(N)))
    assert ln.lists > before


def test_the_next_allreduce_is_agreed_while_one_is_in_flight():
    ln = lane()
    before = ln.handed_while_busy
    big = data(R, 5, 8 << 20, np.float32)  # 32 MiB: tens of milliseconds in the lane
    first = hvd.allreduce_async(big, name="lane.big", op=hvd.Sum)
    until_handed_over(first)
    small = data(R, 6, 1000, np.float64)
    second = hvd.allreduce_async(small, name="lane.after_big", op=hvd.Sum)
    np.testing.assert_allclose(hvd.synchronize(first),
                               sum(data(r, 5, 8 << 20, np.float32).astype(np.float64)
                                   for r in range(N)), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(hvd.synchronize(second),
                               sum(data(r, 6, 1000, np.float64) for r in range(N)))
    # Handed to the lane while the big one still ran there: on every rank, unless a rank
    # came late; one is enough to show it (gathered with mpi4py, not horolite).
    handed = MPI.COMM_WORLD.allgather(ln.handed_while_busy - before)
    assert max(handed) >= 1, handed


def test_a_mismatch_is_named_on_every_rank_then_the_lane_works():
    ln = lane()
    with pytest.raises(TensorMismatchError, match="lane.mismatch"):
        hvd.allreduce(np.ones(3 + (R == 0), np.float32), name="lane.mismatch")
    before = ln.lists
    got = hvd.allreduce(data(R, 9, 999, np.float64), name="lane.after_mismatch", op=hvd.Sum)
    np.testing.assert_allclose(got, sum(data(r, 9, 999, np.float64) for r in range(N)))
    assert ln.lists == before + 1
