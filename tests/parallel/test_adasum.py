"""Rank side: Adasum (op=hvd.Adasum) against a NumPy reference of the pairwise formula,
computed here from every rank's known inputs; Horovod's rules (float dtypes, a
power-of-two number of ranks, the global set) as errors on every rank.

Run by tests/test_matrix_core.py under mpirun -np 1, 2 and 4, and at np 3 the refusals
(-k refused: a count that is not a power of two is refused on every rank).
"""
import numpy as np
import pytest

import horolite as hvd
from horolite.runtime import registry
from adasum_reference import tree

hvd.init(process_sets="dynamic")
RANK, SIZE = hvd.rank(), hvd.size()
RT = registry.global_runtime()
POW2 = SIZE & (SIZE - 1) == 0
needs_pow2 = pytest.mark.skipif(not POW2, reason="Adasum needs a power-of-two number of ranks")
TOL = {np.float16: dict(rtol=5e-3, atol=5e-3), np.float32: dict(rtol=1e-5, atol=1e-6),
       np.float64: dict(rtol=1e-12, atol=1e-12)}


def inputs(seed, shape, dtype):
    """Every rank's input for `seed` (each rank can make anyone's)."""
    return [np.random.RandomState(seed * 100 + r).normal(size=shape).astype(dtype)
            for r in range(SIZE)]


def expected(everyone, shape):
    return tree(everyone).reshape(shape)


def still_works(tag):
    got = hvd.allreduce(np.full(3, RANK, np.float64), op=hvd.Sum, name=f"adasum.after.{tag}")
    np.testing.assert_allclose(got, np.full(3, sum(range(SIZE))))


@needs_pow2
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("shape", [(5,), (3, 4), (64, 33), (1 << 16,)])
def test_allreduce_matches_the_pairwise_tree(dtype, shape):
    everyone = inputs(len(shape) + shape[0], shape, dtype)
    got = hvd.allreduce(everyone[RANK], op=hvd.Adasum, name=f"ada.{np.dtype(dtype).name}.{shape}")
    assert got.dtype == dtype and got.shape == shape
    np.testing.assert_allclose(got.astype(np.float64), expected(everyone, shape), **TOL[dtype])


@needs_pow2
def test_orthogonal_gradients_add_and_parallel_ones_average():
    # What Adasum is for: e_r on each rank (orthogonal) gives their sum; the same vector
    # on every rank gives that vector, not SIZE times it.
    ortho = np.zeros(8)
    ortho[RANK] = 1.0
    got = hvd.allreduce(ortho, op=hvd.Adasum, name="ada.ortho")
    np.testing.assert_allclose(got, [1.0] * SIZE + [0.0] * (8 - SIZE), atol=1e-15)
    same = np.arange(6, dtype=np.float32)
    np.testing.assert_allclose(hvd.allreduce(same, op=hvd.Adasum, name="ada.same"), same,
                               rtol=1e-6)


@needs_pow2
def test_a_zero_vector_keeps_its_partner():
    # A norm below sqrt(DBL_MIN) keeps coefficient 1: zeros leave the partner unchanged.
    x = np.zeros(4) if RANK % 2 == 0 else np.array([1.0, 2.0, 3.0, RANK])
    everyone = [np.zeros(4) if r % 2 == 0 else np.array([1.0, 2.0, 3.0, r]) for r in range(SIZE)]
    got = hvd.allreduce(x, op=hvd.Adasum, name="ada.zero")
    np.testing.assert_allclose(got, tree(everyone), rtol=1e-14)


@needs_pow2
def test_grouped_and_fused_tensors_each_have_their_own_coefficients():
    # Two tensors whose coefficients differ: reduced as one vector they would share one.
    shapes, dtypes = [(7,), (2, 5), (300,)], [np.float32, np.float32, np.float64]
    everyone = [inputs(40 + i, s, d) for i, (s, d) in enumerate(zip(shapes, dtypes))]
    everyone[1] = [t * (10.0 ** r) for r, t in enumerate(everyone[1])]  # very unequal norms
    mine = [e[RANK] for e in everyone]
    batches, tensors = RT.executor.fused_batches, RT.executor.fused_tensors
    # Submitted while no cycle can run (the background thread's turn is held), so each
    # rank's first cycle has all of them: the two float32 tensors fuse, in each call.
    with RT.turns._lock:
        handles = [hvd.allreduce_async(t, op=hvd.Adasum, name=f"ada.fuse.{i}")
                   for i, t in enumerate(mine)]
        group = hvd.grouped_allreduce_async(mine, op=hvd.Adasum, name="ada.group")
    for got in (hvd.synchronize(group), [hvd.synchronize(h) for h in handles]):
        for g, e, s, d in zip(got, everyone, shapes, dtypes):
            assert g.dtype == d and g.shape == s
            np.testing.assert_allclose(g.astype(np.float64), expected(e, s), **TOL[d])
    if SIZE > 1:
        assert (RT.executor.fused_batches - batches, RT.executor.fused_tensors - tensors) == (2, 4)
        whole = tree([np.concatenate([everyone[0][r], everyone[1][r].ravel()]) for r in range(SIZE)])
        assert not np.allclose(whole[:7], expected(everyone[0], (7,)), rtol=1e-3)


@needs_pow2
def test_scale_factors_multiply_the_result():
    # Adasum is linear in a common scale (tree(c x) = c tree(x)): this checks the product
    # of the two factors; the next test checks where the prescale applies.
    everyone = inputs(7, (10,), np.float64)
    got = hvd.allreduce(everyone[RANK], op=hvd.Adasum, name="ada.scaled", prescale_factor=0.5,
                        postscale_factor=3.0)
    np.testing.assert_allclose(got, 3.0 * tree([0.5 * x for x in everyone]), rtol=1e-12)


def hadamard(n):
    h = np.ones((1, 1))
    while len(h) < n:
        h = np.block([[h, h], [h, -h]])
    return h


@needs_pow2
def test_the_prescale_applies_before_the_sum_in_float16():
    # Rows of a Hadamard matrix are orthogonal, so Adasum adds them: the first element of
    # the sum is SIZE * c, 80000 from 2 ranks on, past float16's largest (65504). Scaled
    # by 0.5 first, every partial sum fits; scaled after, the sum is already inf.
    c = min(80000.0 / SIZE, 40000.0)
    everyone = [(c * hadamard(SIZE)[r]).astype(np.float16) for r in range(SIZE)]
    if SIZE > 1:
        assert np.isinf(np.float16(tree(everyone)[0]))  # (unscaled, the sum overflows)
    got = hvd.allreduce(everyone[RANK], op=hvd.Adasum, name="ada.scaled.f16",
                        prescale_factor=0.5, postscale_factor=0.75)
    assert got.dtype == np.float16 and np.isfinite(got).all(), got
    np.testing.assert_allclose(got.astype(np.float64),
                               0.75 * tree([0.5 * x.astype(np.float64) for x in everyone]),
                               **TOL[np.float16])


@needs_pow2
def test_the_input_is_left_alone_and_the_result_is_new():
    x = np.arange(5, dtype=np.float64) + RANK
    keep = x.copy()
    got = hvd.allreduce(x, op=hvd.Adasum, name="ada.input")
    np.testing.assert_array_equal(x, keep)
    assert not np.shares_memory(got, x)


def test_other_rank_counts_are_refused_on_every_rank_naming_the_count():
    x = np.ones(3, np.float32)
    if POW2:
        hvd.allreduce(x, op=hvd.Adasum, name="ada.count")
        return
    for call in (lambda: hvd.allreduce(x, op=hvd.Adasum, name="ada.count"),
                 lambda: hvd.grouped_allreduce([x, x], op=hvd.Adasum, name="ada.count.g")):
        with pytest.raises(hvd.AdasumUnsupportedError, match=f"power-of-two number of ranks "
                           rf"\(1, 2, 4, 8...\), and this job has {SIZE}") as info:
            call()
        assert isinstance(info.value, NotImplementedError)  # Horovod's class
    still_works("count")


def test_integer_tensors_are_refused_naming_the_dtype():
    with pytest.raises(hvd.InvalidCollectiveError,
                       match=r"tensor 'ada.int': Adasum reduces float16, float32, float64, not int32"):
        hvd.allreduce(np.ones(3, np.int32), op=hvd.Adasum, name="ada.int")
    still_works("int")


@pytest.mark.skipif(SIZE == 1, reason="needs at least two ranks")
def test_process_sets_other_than_the_global_one_are_refused():
    subset = hvd.add_process_set([0])
    if RANK == 0:
        with pytest.raises(hvd.AdasumUnsupportedError, match="global process set only"):
            hvd.allreduce(np.ones(2), op=hvd.Adasum, name="ada.set", process_set=subset)
    hvd.remove_process_set(subset)
    still_works("set")


@needs_pow2
@pytest.mark.skipif(SIZE == 1, reason="a mismatch needs two ranks")
def test_ranks_disagreeing_on_adasum_fail_on_every_rank():
    op = hvd.Adasum if RANK == 0 else hvd.Sum
    with pytest.raises(hvd.TensorMismatchError, match="tensor 'ada.mm'.*op"):
        hvd.allreduce(np.ones(4), op=op, name="ada.mm")
    still_works("mm")
