"""Rank side: GradientBuckets, the NumPy/CuPy side of gradient buckets.

Arrays marked ready one at a time (a backward pass, last first) leave in buckets as
each fills; every result is checked against NumPy from each rank's known inputs, and
what travelled against the handles the runtime returned.
"""
import numpy as np
import pytest

import horolite as hvd

hvd.init()
R, N = hvd.rank(), hvd.size()
SHAPES = [(64, 64), (64,), (64, 128), (128,), (128, 10), (10,)]


def arrays(r, dtype, step=0):
    rng = np.random.RandomState(1000 * step + r)
    return [rng.uniform(-1, 1, s).astype(dtype) for s in SHAPES]


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_buckets_leave_as_they_fill_and_average_like_numpy(dtype):
    sizes = [int(np.prod(s)) * np.dtype(dtype).itemsize for s in SHAPES]
    buckets = hvd.GradientBuckets(sizes, f"np_buckets.{np.dtype(dtype).name}",
                                 cap_bytes=5000 * np.dtype(dtype).itemsize)
    assert len(buckets.buckets) >= 3
    for step in range(3):  # later steps hit the response cache under the same names
        mine = arrays(R, dtype, step)
        sent = []
        for i in reversed(range(len(SHAPES))):
            handle = buckets.ready(i, mine[i])
            if handle is not None:
                sent.append(i)
                k = len(sent) - 1
                # the bucket left with its last member: the runtime took it then
                assert i == min(buckets.buckets[k])
        assert len(sent) == len(buckets.buckets)
        got = buckets.results()
        want = [np.mean([arrays(r, dtype, step)[k].astype(np.float64) for r in range(N)], axis=0)
                for k in range(len(SHAPES))]
        tol = 2e-3 if dtype == np.float16 else 1e-6
        for g, w in zip(got, want):
            assert g.dtype == dtype
            np.testing.assert_allclose(g.astype(np.float64), w, rtol=tol, atol=tol)


def test_the_first_bucket_is_on_its_way_before_the_last_array_is_ready():
    sizes = [int(np.prod(s)) * 4 for s in SHAPES]
    buckets = hvd.GradientBuckets(sizes, "np_buckets.early", cap_bytes=20_000)
    mine = arrays(R, np.float32)
    first = None
    for i in reversed(range(len(SHAPES))):
        if i == 0:  # before the last array is marked ready, the first bucket completes
            first.result(timeout=60)
        handle = buckets.ready(i, mine[i])
        first = first or handle
    got = buckets.results()
    want = np.mean([arrays(r, np.float32)[0].astype(np.float64) for r in range(N)], axis=0)
    np.testing.assert_allclose(got[0], want, rtol=1e-6, atol=1e-6)


def test_bad_use_is_named():
    buckets = hvd.GradientBuckets([16, 16], "np_buckets.bad", cap_bytes=16)
    with pytest.raises(IndexError, match="np_buckets.bad: no array 5"):
        buckets.ready(5, np.zeros(4, np.float32))
    buckets.ready(1, np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="array 1 was already marked ready"):
        buckets.ready(1, np.zeros(4, np.float32))
    with pytest.raises(ValueError, match=r"arrays \[0\] were never marked ready"):
        buckets.results()
    with pytest.raises(ValueError, match="needs a name"):
        hvd.GradientBuckets([16], "")


def test_a_step_discarded_on_one_rank_fails_there_and_everywhere_then_works():
    if N < 2:
        pytest.skip("needs at least two ranks")
    sizes = [int(np.prod(s)) * 4 for s in SHAPES]
    buckets = hvd.GradientBuckets(sizes, "np_buckets.discard", cap_bytes=20_000)
    mine = arrays(R, np.float32)
    n = len(SHAPES)
    if R == 1:  # its backward pass fails after the last layers' bucket left
        for i in reversed(range(n)):
            if buckets.ready(i, mine[i]) is not None:
                break
        buckets.discard("its backward pass raised")
    else:
        for i in reversed(range(n)):
            buckets.ready(i, mine[i])
        with pytest.raises(hvd.TensorMismatchError,
                           match="rank 1 will never send it: its backward pass raised"):
            buckets.results()
    for step in (1, 2):  # the next steps work
        for i in reversed(range(n)):
            buckets.ready(i, arrays(R, np.float32, step)[i])
        got = buckets.results()
        want = [np.mean([arrays(r, np.float32, step)[k].astype(np.float64) for r in range(N)], axis=0)
                for k in range(n)]
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


def test_a_request_sent_again_while_its_last_run_is_in_flight_waits_for_it():
    # Rank 1's run stops after its first request left (a TensorFlow step that raised) and
    # its next run sends that request again at once, while the first is still in flight:
    # the others have not sent theirs yet (they wait for rank 1's word over mpi4py). The new
    # one goes once the old one is done; two of one name are never in flight on a rank.
    if N < 2:
        pytest.skip("needs at least two ranks")
    from mpi4py import MPI
    from horolite.api.buckets import BucketRuns
    comm = MPI.COMM_WORLD
    names = ["np_runs.b0", "np_runs.b1"]
    runs = BucketRuns(names)

    def send(k):
        return lambda a: hvd.allreduce_async(a, name=names[k], op=hvd.Sum)

    def x(r, k, run):
        return np.full(3 + k, 10.0 * r + k + 100.0 * run)

    def total(k, run):
        return sum(x(r, k, run) for r in range(N))
    if R == 1:
        old0 = runs.submit(0, send(0), x(R, 0, 0))
        try:
            new0 = runs.submit(0, send(0), x(R, 0, 1))  # the next run: b1 of the last is abandoned
        finally:  # (even if that raised: the others must not wait for this word forever)
            for peer in range(N):
                if peer != R:
                    comm.send("sent again", dest=peer, tag=61)
        new1 = runs.submit(1, send(1), x(R, 1, 1))
    else:
        assert comm.recv(source=1, tag=61) == "sent again"
        old0 = runs.submit(0, send(0), x(R, 0, 0))
        old1 = runs.submit(1, send(1), x(R, 1, 0))
        with pytest.raises(hvd.TensorMismatchError, match="rank 1 will never send it"):
            old1.result(timeout=60)
        new0 = runs.submit(0, send(0), x(R, 0, 1))
        new1 = runs.submit(1, send(1), x(R, 1, 1))
    np.testing.assert_array_equal(old0.result(timeout=60), total(0, 0))
    np.testing.assert_array_equal(new0.result(timeout=60), total(0, 1))
    np.testing.assert_array_equal(new1.result(timeout=60), total(1, 1))
