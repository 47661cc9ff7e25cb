"""Bad input: a clear error naming the tensor, the difference and the ranks, on every
rank; and the next collective still works."""
import numpy as np
import pytest

import horolite as hvd

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()

multi = pytest.mark.skipif(SIZE == 1, reason="a mismatch needs at least two ranks")


def ranks_text(ranks):
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def still_works(tag):
    got = hvd.allreduce(np.full(3, RANK, np.float64), op=hvd.Sum, name=f"good.after.{tag}")
    np.testing.assert_allclose(got, np.full(3, sum(range(SIZE))))


@multi
def test_mismatched_dtype():
    dtype = np.float32 if RANK == 0 else np.int32
    with pytest.raises(hvd.TensorMismatchError) as info:
        hvd.allreduce(np.ones(4, dtype), name="mm.dtype")
    msg = str(info.value)
    assert "tensor 'mm.dtype'" in msg and "mismatched dtype" in msg
    assert f"rank 0 had float32, {ranks_text(list(range(1, SIZE)))} had int32" in msg
    still_works("dtype")


@multi
def test_mismatched_shape():
    with pytest.raises(hvd.TensorMismatchError, match=r"tensor 'mm.shape': mismatched shape: rank 0 had \(2, 3\)"):
        hvd.allreduce(np.ones((2, 3 + RANK)), name="mm.shape")
    still_works("shape")


@multi
def test_allgather_mismatch_beyond_first_dim():
    # The first dimension may differ; the second may not.
    with pytest.raises(hvd.TensorMismatchError, match="shape beyond the first dimension"):
        hvd.allgather(np.ones((RANK + 1, 2 + (RANK % 2))), name="mm.ag")
    still_works("ag")


@multi
def test_mismatched_collective_kind():
    x = np.ones((SIZE, 2))
    with pytest.raises(hvd.TensorMismatchError, match="mismatched collective: rank 0 had allreduce"):
        if RANK == 0:
            hvd.allreduce(x, name="mm.kind")
        else:
            hvd.allgather(x, name="mm.kind")
    still_works("kind")


@multi
def test_mismatched_reduce_op():
    op = hvd.Sum if RANK == 0 else hvd.Max
    with pytest.raises(hvd.TensorMismatchError, match="mismatched reduce op: rank 0 had Sum, .* had Max"):
        hvd.allreduce(np.ones(2), op=op, name="mm.op")
    still_works("op")


@multi
def test_mismatched_root_rank():
    with pytest.raises(hvd.TensorMismatchError, match="mismatched root rank: rank 0 had 0, rank 1 had 1"):
        hvd.broadcast(np.ones(2), root_rank=RANK, name="mm.root")
    still_works("root")


@multi
def test_mismatched_scale_factors():
    with pytest.raises(hvd.TensorMismatchError, match="mismatched prescale factor"):
        hvd.allreduce(np.ones(2), name="mm.pre", prescale_factor=1.0 + RANK)
    with pytest.raises(hvd.TensorMismatchError, match="mismatched postscale factor"):
        hvd.allreduce(np.ones(2), name="mm.post", postscale_factor=1.0 + RANK)
    still_works("scale")


@multi
def test_mismatch_after_cached_use():
    # The same name, first agreed (and cached), then with a shape differing on one rank.
    for _ in range(3):
        hvd.allreduce(np.ones(4), name="mm.cached")
    shape = (5,) if RANK == SIZE - 1 else (4,)
    with pytest.raises(hvd.TensorMismatchError, match=f"{ranks_text([SIZE - 1])} had \\(5,\\)"):
        hvd.allreduce(np.ones(shape), name="mm.cached")
    np.testing.assert_allclose(hvd.allreduce(np.ones(4), name="mm.cached"), np.ones(4))


def test_bad_root_rank():
    with pytest.raises(hvd.InvalidCollectiveError,
                       match=f"tensor 'bad.root': root rank {SIZE} is out of range for a job of {SIZE} ranks"):
        hvd.broadcast(np.ones(2), root_rank=SIZE, name="bad.root")
    still_works("badroot")


def test_unsupported_dtype():
    with pytest.raises(hvd.InvalidCollectiveError, match="tensor 'bad.dtype': dtype complex64 is not supported"):
        hvd.allreduce(np.ones(2, np.complex64), name="bad.dtype")
    with pytest.raises(hvd.InvalidCollectiveError, match="dtype bool is not supported by allreduce"):
        hvd.allreduce(np.ones(2, bool), name="bad.bool")
    with pytest.raises(hvd.InvalidCollectiveError, match="Adasum reduces float16, float32, float64"):
        hvd.allreduce(np.ones(2, np.int64), op=hvd.Adasum, name="bad.adasum")
    still_works("dtype-unsupported")


def test_integer_tensor_with_a_non_finite_scale_factor():
    # Used to reach the kernels on the background thread and abort the job.
    with pytest.raises(hvd.InvalidCollectiveError,
                       match=r"tensor 'bad.scale': an integer tensor \(int32\) needs finite scale "
                             r"factors, got prescale_factor=inf"):
        hvd.allreduce(np.ones(3, np.int32), prescale_factor=float("inf"), name="bad.scale")
    with pytest.raises(hvd.InvalidCollectiveError, match=r"'bad.group.1': an integer tensor"):
        hvd.grouped_allreduce([np.ones(2), np.ones(2, np.int64)], postscale_factor=float("nan"),
                              name="bad.group")
    # Floats take inf as IEEE arithmetic does.
    assert np.isinf(hvd.allreduce(np.ones(2), prescale_factor=float("inf"), name="inf.float")).all()
    still_works("scale-nonfinite")


def test_integer_reducescatter_with_a_non_finite_scale_factor():
    with pytest.raises(hvd.InvalidCollectiveError,
                       match=r"tensor 'bad.rs.scale': an integer tensor \(int64\) needs finite scale "
                             r"factors, got prescale_factor=1.0, postscale_factor=nan"):
        hvd.reducescatter(np.ones((SIZE, 2), np.int64), postscale_factor=float("nan"),
                          name="bad.rs.scale")
    with pytest.raises(hvd.InvalidCollectiveError, match=r"'bad.grs.0': an integer tensor"):
        hvd.grouped_reducescatter([np.ones((SIZE, 2), np.uint8)], prescale_factor=float("inf"),
                                  name="bad.grs")
    still_works("rs-scale-nonfinite")


def test_duplicate_name_in_flight():
    # A large allreduce ahead of it keeps "dup" in flight while the same name comes again
    # (alone, at np 1, a small one can be done before the next line runs).
    ahead = hvd.allreduce_async(np.ones(32 << 20, np.float32), name="dup.ahead")
    first = hvd.allreduce_async(np.ones(2), name="dup")
    with pytest.raises(hvd.DuplicateNameError, match="tensor 'dup': a collective with this name is already in flight"):
        hvd.allreduce_async(np.ones(2), name="dup")
    np.testing.assert_allclose(hvd.synchronize(first), np.ones(2))
    assert hvd.synchronize(ahead)[-1] == 1.0
    # Once done, the name is free again.
    np.testing.assert_allclose(hvd.allreduce(np.ones(2), name="dup"), np.ones(2))


def test_alltoall_bad_splits():
    with pytest.raises(hvd.InvalidCollectiveError, match="splits .* must have"):
        hvd.alltoall(np.ones(3), splits=[1] * (SIZE + 1), name="bad.splits")
    if SIZE > 1:
        with pytest.raises(hvd.InvalidCollectiveError, match="not divisible"):
            hvd.alltoall(np.ones(SIZE + 1), name="bad.even")
    still_works("splits")


@multi
def test_grouped_member_shapes_mismatch():
    # Same total size, different members: caught, not silently mis-split.
    shapes = [(2,), (3,)] if RANK == 0 else [(3,), (2,)]
    with pytest.raises(hvd.TensorMismatchError,
                       match=r"tensor 'grp.mm': mismatched group member shapes: rank 0 had \[\(2,\), \(3,\)\]"):
        hvd.grouped_allreduce([np.ones(s) for s in shapes], name="grp.mm")
    still_works("group")


@multi
def test_grouped_allgather_member_mismatch_names_the_member():
    # Member 1 differs beyond the first dimension on odd ranks: every rank's error names it;
    # the group's other member does not hide it.
    arrays = [np.ones((RANK + 1, 2)), np.ones((1, 2 + (RANK % 2)))]
    with pytest.raises(hvd.TensorMismatchError, match=r"tensor 'gag.mm.1'.*shape beyond the first dimension"):
        hvd.grouped_allgather(arrays, name="gag.mm")
    still_works("gag")
