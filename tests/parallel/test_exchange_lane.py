"""Rank side: the exchange lane (horolite/execution/lane.py).

Agreed allreduces run on a thread of their own, while the background thread agrees
the next ones. Run where the lane is on (HOROLITE_EXCHANGE_PIPELINE=1 on this host,
or pretend hosts, where `auto` turns it on): every result is checked against NumPy
from each rank's known inputs, with broadcasts, gathers and errors (which run on the
background thread once the lane is empty) in between, and (HOROLITE_AUTOTUNE=1) while
rank 0 moves the fusion threshold.
"""
import contextlib
import time

import numpy as np
import pytest
from horolite.core.mpi_library import MPI  # the job world's: mpi4py's under mpirun

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


class HookedExecutor:
    """The lane's executor with `before()` called as the lane starts each list;
    everything else is the executor's."""

    def __init__(self, executor, before):
        self.executor, self.before = executor, before

    def __getattr__(self, name):
        return getattr(self.executor, name)

    def run(self, *args):
        self.before()
        return self.executor.run(*args)


@contextlib.contextmanager
def before_each_list(before):
    ln = RT.lane
    ln._executor = HookedExecutor(ln._executor, before)
    try:
        yield
    finally:
        ln._executor = ln._executor.executor


def test_the_next_allreduce_agreed_while_one_is_in_flight_follows_it_at_once():
    ln = lane()
    before = (ln.handed_while_busy, ln.followed)
    big = np.full(8 << 20, R + 1, np.float32)  # 32 MiB: tens of milliseconds in the lane
    held = []

    def hold_the_first_until_the_next_is_handed_over():
        # (so that on every rank one is agreed while the big one is in flight, however
        # late a rank's caller comes)
        deadline = time.monotonic() + 30
        while not held and not ln._jobs and time.monotonic() < deadline:
            time.sleep(0.0005)
        held.append(True)

    with before_each_list(hold_the_first_until_the_next_is_handed_over):
        first = hvd.allreduce_async(big, name="lane.big", op=hvd.Sum)
        until_handed_over(first)
        handed = time.monotonic()
        small = data(R, 6, 1000, np.float64)
        second = hvd.allreduce_async(small, name="lane.after_big", op=hvd.Sum)
        np.testing.assert_array_equal(hvd.synchronize(first),
                                      np.full(8 << 20, N * (N + 1) / 2, np.float32))
        took = time.monotonic() - handed  # the big one's time in the lane, and more
        np.testing.assert_allclose(hvd.synchronize(second),
                                   sum(data(r, 6, 1000, np.float64) for r in range(N)))
    # On every rank (gathered with mpi4py, not horolite): the small one was handed over
    # while the big one ran, and the lane started it straight after the big one ended,
    # on its own thread (no cycle, no control round between), within a sliver of the
    # big one's own time.
    seen = MPI.COMM_WORLD.allgather((ln.handed_while_busy - before[0], ln.followed - before[1],
                                     ln.follow_gap, took))
    for rank, (handed_over, followed, gap, took) in enumerate(seen):
        assert handed_over == 1 and followed == 1, (rank, seen)
        assert gap < took / 4, (rank, seen)


def wave_while_a_big_one_holds_the_lane(groups, big):
    """One 32 MiB allreduce, and while the lane runs it, `groups` of small allreduces,
    the members of a group submitted at once, the groups a few milliseconds apart; then,
    once it is done, the groups again, while the lane works through the first ones: lists
    agreed while earlier ones wait in the lane, and start. The same names each wave, as a
    step's; every result checked exactly."""
    first = hvd.allreduce_async(big + R, name="lane.tune.big", op=hvd.Sum)
    until_handed_over(first)
    handles = []
    for k in range(2):
        for g, group in enumerate(groups):
            mine = [base + R for base in group]  # (made before: the members leave together)
            handles += [(base, hvd.allreduce_async(x, name=f"lane.tune.{k}.{g}.{i}", op=hvd.Sum))
                        for i, (base, x) in enumerate(zip(group, mine))]
            time.sleep(0.005)
        if k == 0:
            np.testing.assert_array_equal(hvd.synchronize(first), N * big + N * (N - 1) / 2)
    for base, h in handles:
        np.testing.assert_array_equal(hvd.synchronize(h), N * base + N * (N - 1) / 2)


def test_fusion_stays_alike_on_every_rank_while_autotune_moves_the_threshold():
    # Lists of 1.5, 6 and 12 MiB: each fused one way below a threshold among 1, 4 and
    # 16 MiB and another above it. Each rank's lane runs a list later than the cycle that
    # agreed it, by its own lag (here rank 0's starts each list 50 ms after the others'):
    # planned with the threshold of that cycle, the ranks fuse alike (else a ring carries
    # messages of different sizes: a wrong sum, or an error).
    ln = lane()
    before = ln.lists
    tuner = RT.autotuner  # rank 0's; the others follow its setting
    groups = [[(np.arange(n, dtype=np.float32) % 61) + g + i for i in range(count)]  # exact
              for g, (count, n) in enumerate([(6, 64 << 10), (6, 256 << 10), (3, 1 << 20)] * 3)]
    big = np.ones(8 << 20, np.float32)
    thresholds, wave, deadline = set(), 0, time.monotonic() + 60
    while True:
        with before_each_list(lambda: time.sleep(0.05 if R == 0 else 0)):
            wave_while_a_big_one_holds_the_lane(groups, big)
        thresholds.add(RT.executor.fusion_threshold)
        wave += 1
        # (rank 0 decides for all: until autotune settles, or 3 waves where it is off)
        go_on = tuner is not None and not tuner.done and time.monotonic() < deadline \
            if RT.config.autotune else wave < 3
        if not MPI.COMM_WORLD.bcast(go_on if R == 0 else None, root=0):
            break
    assert ln.lists > before
    if RT.config.autotune:
        assert MPI.COMM_WORLD.bcast(tuner.done if R == 0 else None, root=0), \
            "autotune did not settle within 60 s"
        # It moved the threshold meanwhile (how often depends on what it measures: on 4
        # ranks of 2 busy cores it settled after two)
        assert len(thresholds) >= 2, thresholds


def test_a_mismatch_is_named_on_every_rank_then_the_lane_works():
    ln = lane()
    with pytest.raises(TensorMismatchError, match="lane.mismatch"):
        hvd.allreduce(np.ones(3 + (R == 0), np.float32), name="lane.mismatch")
    before = ln.lists
    got = hvd.allreduce(data(R, 9, 999, np.float64), name="lane.after_mismatch", op=hvd.Sum)
    np.testing.assert_allclose(got, sum(data(r, 9, 999, np.float64) for r in range(N)))
    assert ln.lists == before + 1
