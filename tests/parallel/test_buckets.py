"""Rank side: GradientBuckets, the NumPy/CuPy side of gradient buckets.

Arrays marked ready one at a time (a backward pass, last first) leave in buckets as
each fills; every result is checked against NumPy from each rank's known inputs, and
what travelled against the handles the runtime returned.
"""
import time

import numpy as np
import pytest

import horolite as hvd
from horolite.elastic.run import is_runtime_failure
from adasum_reference import tree

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


def assert_a_peers_failure(error, peer=1):
    """A step abandoned on `peer` fails here as a runtime failure naming it, not as a
    mismatch: elastic restarts on it, and a rank that dies of it does not say it was the cause."""
    assert getattr(error, "horolite_peer", None) == peer, repr(error)
    assert not isinstance(error, ValueError), repr(error)
    assert is_runtime_failure(error)


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
        with pytest.raises(hvd.HorovodInternalError,
                           match="rank 1 will never send it: its backward pass raised") as caught:
            buckets.results()
        assert_a_peers_failure(caught.value)
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
    from horolite.core.mpi_library import MPI  # the job world's: mpi4py's under mpirun
    comm = MPI.COMM_WORLD
    runs, send, x, total = runs_case("np_runs", 2)
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
        with pytest.raises(hvd.HorovodInternalError, match="rank 1 will never send it") as caught:
            old1.result(timeout=60)
        assert_a_peers_failure(caught.value)
        new0 = runs.submit(0, send(0), x(R, 0, 1))
        new1 = runs.submit(1, send(1), x(R, 1, 1))
    np.testing.assert_array_equal(old0.result(timeout=60), total(0, 0))
    np.testing.assert_array_equal(new0.result(timeout=60), total(0, 1))
    np.testing.assert_array_equal(new1.result(timeout=60), total(1, 1))


# Arrays (shape, dtype) cut at 20 000 bytes into buckets [3, 4, 5] (float64, float32, float64),
# [2] (float32 alone: one packed request) and [0, 1] (float32 and float64): a bucket of two
# dtypes cannot be packed, so it goes out as separate requests `<bucket>.0`, `<bucket>.1`.
MIXED = [((64, 64), np.float32), ((64,), np.float64), ((64, 128), np.float32),
         ((128,), np.float64), ((128, 10), np.float32), ((10,), np.float64)]


@pytest.mark.parametrize("when", ["first", "cached"])
def test_a_step_discarded_with_a_bucket_of_mixed_dtypes_fails_everywhere_then_works(when):
    discarded_with_buckets_that_cannot_be_packed("mixed", when)


@pytest.mark.parametrize("when", ["first", "cached"])
def test_a_step_discarded_with_adasum_buckets_fails_everywhere_then_works(when):
    if N > 1 and N & (N - 1):
        pytest.skip("Adasum needs a power-of-two number of ranks")
    discarded_with_buckets_that_cannot_be_packed("adasum", when)


def discarded_with_buckets_that_cannot_be_packed(case, when):
    # Rank 1 fails after the last layers' bucket left: in its first step (it never sent the
    # other buckets in this process), or after a whole one (the others' requests are then
    # response-cache hits). Its notices cover the buckets the others sent as separate
    # requests (mixed dtypes; with Adasum every bucket): their step fails in seconds
    # naming rank 1, its discard() returns, and the next steps are whole.
    if N < 2:
        pytest.skip("needs at least two ranks")
    specs = MIXED if case == "mixed" else [(shape, np.float32) for shape, _ in MIXED]
    op = hvd.Average if case == "mixed" else hvd.Adasum

    def mine(r, step):
        rng = np.random.RandomState(1000 * step + r)
        return [rng.uniform(-1, 1, shape).astype(dtype) for shape, dtype in specs]
    sizes = [int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in specs]
    buckets = hvd.GradientBuckets(sizes, f"np_buckets.unpacked.{case}.{when}", op=op,
                                  cap_bytes=20_000)
    assert buckets.buckets == [[3, 4, 5], [2], [0, 1]]
    n = len(specs)

    def whole_step(step):
        for i in reversed(range(n)):
            buckets.ready(i, mine(R, step)[i])
        got = buckets.results()
        everyone = [mine(r, step) for r in range(N)]
        for k, (g, (shape, dtype)) in enumerate(zip(got, specs)):
            assert g.dtype == dtype and g.shape == shape
            if case == "mixed":
                want = np.mean([e[k].astype(np.float64) for e in everyone], axis=0)
            else:
                want = tree([e[k] for e in everyone]).reshape(shape)
            np.testing.assert_allclose(g.astype(np.float64), want, rtol=1e-5, atol=1e-6)
    if when == "cached":
        whole_step(3)
    started = time.monotonic()
    if R == 1:  # its backward pass fails after the first bucket left
        for i in reversed(range(n)):
            if buckets.ready(i, mine(R, 0)[i]) is not None:
                break
        buckets.discard("its backward pass raised")
        assert time.monotonic() - started < 20, "discard() waited for its notices too long"
    else:
        handles = [h for h in (buckets.ready(i, mine(R, 0)[i]) for i in reversed(range(n)))
                   if h is not None]
        with pytest.raises(hvd.HorovodInternalError,
                           match="rank 1 will never send it: its backward pass raised") as caught:
            buckets.results()
        assert time.monotonic() - started < 20, "the others waited for the abandoned buckets"
        assert_a_peers_failure(caught.value)
        assert handles[0].exception() is None  # the bucket rank 1 sent
        for handle in handles[1:]:  # both forms: one request, and separate ones
            assert "rank 1 will never send it" in str(handle.exception())
            assert_a_peers_failure(handle.exception())
    for step in (1, 2):  # the next steps are whole
        whole_step(step)


def runs_case(prefix, count):
    """(BucketRuns over `count` names, send(k), x(r, k, run), total(k, run)) for a case
    where rank 1 runs ahead while the others wait for its word over mpi4py."""
    from horolite.api.buckets import BucketRuns
    names = [f"{prefix}.b{k}" for k in range(count)]

    def send(k):
        return lambda a: hvd.allreduce_async(a, name=names[k], op=hvd.Sum)

    def x(r, k, run):
        return np.full(3 + k, 10.0 * r + k + 100.0 * run)

    def total(k, run):
        return sum(x(r, k, run) for r in range(N))
    return BucketRuns(names), send, x, total


def tell_the_others(tag):
    from horolite.core.mpi_library import MPI  # the job world's: mpi4py's under mpirun
    for peer in range(N):
        if peer != R:
            MPI.COMM_WORLD.send("go", dest=peer, tag=tag)


def wait_for_rank_1(tag):
    from horolite.core.mpi_library import MPI  # the job world's: mpi4py's under mpirun
    assert MPI.COMM_WORLD.recv(source=1, tag=tag) == "go"


def test_a_request_sent_again_by_two_failed_runs_before_the_first_notice_is_answered():
    # Rank 1's runs 0 and 1 stop after their first request (a retry loop over an error of
    # its own), and run 2 begins, all before the others sent anything: run 1's notice waits
    # behind run 0's (two of one name are never in flight), nothing raises on rank 1, the
    # others' runs 0 and 1 fail naming it, and run 2 is whole everywhere.
    if N < 2:
        pytest.skip("needs at least two ranks")
    runs, send, x, total = runs_case("np_runs_twice", 2)
    if R == 1:
        try:
            first = [runs.submit(0, send(0), x(R, 0, run)) for run in range(3)]
        finally:  # (even if that raised: the others must not wait for this word forever)
            tell_the_others(62)
        last1 = runs.submit(1, send(1), x(R, 1, 2))
    else:
        wait_for_rank_1(62)
        first = []
        for run in range(2):
            first.append(runs.submit(0, send(0), x(R, 0, run)))
            with pytest.raises(hvd.HorovodInternalError, match="rank 1 will never send it") as caught:
                runs.submit(1, send(1), x(R, 1, run)).result(timeout=60)
            assert_a_peers_failure(caught.value)
        first.append(runs.submit(0, send(0), x(R, 0, 2)))
        last1 = runs.submit(1, send(1), x(R, 1, 2))
    for run, handle in enumerate(first):
        np.testing.assert_array_equal(handle.result(timeout=60), total(0, run))
    np.testing.assert_array_equal(last1.result(timeout=60), total(1, 2))


def test_a_notice_that_raised_is_sent_by_the_next_try_and_the_job_goes_on(monkeypatch):
    # Rank 1's run 0 stops after its first request; its run 1 finds that, and the second of
    # its two notices raises. The next try sends only the notice that did not go (two of
    # one name would be refused), the others' run 0 fails naming rank 1, and run 1 is whole.
    if N < 2:
        pytest.skip("needs at least two ranks")
    import horolite.api.buckets as buckets_module
    runs, send, x, total = runs_case("np_runs_raised", 3)
    if R == 1:
        try:
            old0 = runs.submit(0, send(0), x(R, 0, 0))
            real, calls = buckets_module.abandon_async, []

            def second_fails(name, *args):
                calls.append(name)
                if len(calls) == 2:
                    raise RuntimeError("injected: the notice could not be sent")
                return real(name, *args)
            monkeypatch.setattr(buckets_module, "abandon_async", second_fails)
            with pytest.raises(RuntimeError, match="injected"):
                runs.submit(0, send(0), x(R, 0, 1))
            new = [runs.submit(0, send(0), x(R, 0, 1))]  # the next try
            assert calls == ["np_runs_raised.b1", "np_runs_raised.b2", "np_runs_raised.b2"]
        finally:
            tell_the_others(63)
        new += [runs.submit(k, send(k), x(R, k, 1)) for k in (1, 2)]
    else:
        wait_for_rank_1(63)
        old0 = runs.submit(0, send(0), x(R, 0, 0))
        for k in (1, 2):
            with pytest.raises(hvd.HorovodInternalError,
                               match=r"rank 1 will never send it: its previous run of this step "
                                     r"failed there after 1 of 3 buckets had left") as caught:
                runs.submit(k, send(k), x(R, k, 0)).result(timeout=60)
            assert_a_peers_failure(caught.value)
        new = [runs.submit(k, send(k), x(R, k, 1)) for k in range(3)]
    np.testing.assert_array_equal(old0.result(timeout=60), total(0, 0))
    for k, handle in enumerate(new):
        np.testing.assert_array_equal(handle.result(timeout=60), total(k, 1))
