"""The native kernels against NumPy references, on every instruction-set level
this CPU runs (the portable build and, on x86-64, the AVX2 one)."""
import ml_dtypes
import numpy as np
import pytest

from horolite.core import kernels
from horolite._native import ffi, lib
from horolite.core.ops import REDUCIBLE_DTYPES, ReduceOp, dtype_from_name

DTYPES = list(REDUCIBLE_DTYPES)
INTS = ["uint8", "int8", "uint16", "int16", "int32", "int64"]
OPS = [ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT]
LENGTHS = [0, 1, 7, 1000, 100003]
LEVELS = [level for level in range(4) if lib.hl_isa_name(level) != ffi.NULL]
BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture(params=LEVELS, ids=lambda lv: ffi.string(lib.hl_isa_name(lv)).decode())
def level(request):
    before = lib.hl_isa_get()
    assert lib.hl_isa_set(request.param) == 0
    yield request.param
    lib.hl_isa_set(before)


# ---- references -------------------------------------------------------------

def compute_dtype(dtype):
    """NumPy computes float16/bfloat16 in float32, like the kernels."""
    return np.dtype(np.float32) if dtype.name in ("float16", "bfloat16") else dtype


def np_op(op, a, b):
    return {ReduceOp.SUM: np.add, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum,
            ReduceOp.PRODUCT: np.multiply}[op](a, b)


def np_scale(x, factor, dtype):
    """x (in the compute dtype) * factor, stored as dtype; 1.0 is a copy."""
    if factor == 1.0:
        return x.astype(dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        # saturate to the largest double that fits (2**63 - 1024 for int64)
        hi = float(info.max)
        if int(hi) > info.max:
            hi = np.nextafter(hi, 0.0)
        y = np.trunc(x.astype(np.float64) * factor)
        return np.clip(y, float(info.min), hi).astype(dtype)
    return (x * x.dtype.type(factor)).astype(dtype)


def reference_reduce(a, b, op, postscale):
    cd = compute_dtype(a.dtype)
    with np.errstate(all="ignore"):
        r = np_op(op, a.astype(cd), b.astype(cd))
        if postscale != 1.0:
            if a.dtype.itemsize == 2 and a.dtype.kind not in "iu":
                r = r.astype(a.dtype).astype(cd)  # 16-bit floats: rounded, then scaled (Horovod's)
            return np_scale(r, postscale, a.dtype)
        return r.astype(a.dtype)


def assert_same(got, want):
    """Exactly equal values (nan matches nan, -0 matches 0): the kernels do the
    same IEEE operations in the same order as the reference."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype.kind in "iu":
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float64))


SPECIALS = [0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, 6e-8, -3e-5, 1e-40, 65504.0,
            70000.0, 3.0e38]


def make(dtype_name, n, seed):
    dtype = dtype_from_name(dtype_name)
    rng = np.random.default_rng(seed)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        # the full range, so sums and products wrap around
        return rng.integers(info.min, info.max, size=n, dtype=dtype, endpoint=True)
    x = rng.standard_normal(n) * rng.choice([1e-6, 1e-2, 1.0, 100.0, 1e4], size=n)
    if n >= 7:
        # specials at random places: nan/inf propagation, signed zeros, and
        # subnormal and overflowing values of the narrow types
        where = rng.choice(n, size=min(n, 3 * len(SPECIALS)), replace=False)
        x[where] = np.resize(SPECIALS, where.size)
    with np.errstate(over="ignore"):
        return x.astype(dtype)


# ---- hl_reduce: every dtype x op x postscale x length ------------------------

@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("postscale", [1.0, 0.25, 0.3])
@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_matches_numpy(level, dtype, op, postscale, n):
    a, b = make(dtype, n, 1), make(dtype, n, 2)
    want = reference_reduce(a, b, op, postscale)
    kernels.reduce_into(a, b, op, postscale)
    assert_same(a, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_average_reduces_like_sum(level, dtype):
    a, b = make(dtype, 1000, 3), make(dtype, 1000, 4)
    want = reference_reduce(a, b, ReduceOp.SUM, 0.5)
    kernels.reduce_into(a, b, ReduceOp.AVERAGE, 0.5)
    assert_same(a, want)


def test_reduce_in_place_on_itself_and_on_2d(level):
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    kernels.reduce_into(a, a, ReduceOp.SUM)
    np.testing.assert_array_equal(a, 2 * np.arange(12, dtype=np.float32).reshape(3, 4))


@pytest.mark.parametrize("dtype,big", [("uint8", 255), ("int8", 127), ("uint16", 65535),
                                       ("int16", 32767), ("int32", 2**31 - 1), ("int64", 2**63 - 1)])
def test_integer_sum_and_product_wrap_around(level, dtype, big):
    dt = np.dtype(dtype)
    a = np.array([big, big, 3], dtype=dt)
    kernels.reduce_into(a, np.array([1, big, 0], dtype=dt), ReduceOp.SUM)
    bits = dt.itemsize * 8
    lo = 0 if dt.kind == "u" else -(2 ** (bits - 1))
    wrap = lambda v: (v - lo) % 2**bits + lo  # noqa: E731
    assert a.tolist() == [wrap(big + 1), wrap(2 * big), 3]
    a = np.array([big, 16], dtype=dt)
    kernels.reduce_into(a, np.array([big, 2 ** (bits - 4)], dtype=dt), ReduceOp.PRODUCT)
    assert a.tolist() == [wrap(big * big), wrap(16 * 2 ** (bits - 4))]


@pytest.mark.parametrize("dtype", INTS)
def test_integer_scale_truncates_toward_zero(level, dtype):
    dt = np.dtype(dtype)
    values = [0, 1, 3, 5, 7, 100] + ([] if dt.kind == "u" else [-1, -3, -5, -7, -100])
    a = np.array(values, dtype=dt)
    kernels.reduce_into(a, np.zeros_like(a), ReduceOp.SUM, 0.5)
    assert a.tolist() == [int(v / 2) for v in values]  # int() truncates toward zero


@pytest.mark.parametrize("dtype", INTS)
def test_integer_scale_saturates(level, dtype):
    info = np.iinfo(dtype)
    a = np.array([info.max, info.min, info.max // 2], dtype=dtype)
    kernels.scale_into(a, a, 4.0)
    if dtype == "int64":
        # saturates to the largest double below 2**63
        assert a.tolist() == [2**63 - 1024, info.min, 2**63 - 1024]
    else:
        assert a.tolist() == [info.max, info.min, info.max]
    if info.min < 0:
        a = np.array([info.max, info.min], dtype=dtype)
        kernels.scale_into(a, a, -2.0)
        assert a[0] == info.min and a[1] >= info.max - 1023


@pytest.mark.parametrize("factor", [np.nan, np.inf, -np.inf])
def test_integer_scale_rejects_non_finite_factor(factor):
    a = np.arange(4, dtype=np.int32)
    with pytest.raises(ValueError, match="finite"):
        kernels.reduce_into(a, a.copy(), ReduceOp.SUM, factor)
    with pytest.raises(ValueError, match="finite"):
        kernels.scale_into(a, a, factor)
    np.testing.assert_array_equal(a, np.arange(4))


def test_float_nan_factor_gives_nan(level):
    a = np.ones(5, dtype=np.float16)
    kernels.scale_into(a, a, np.nan)
    assert np.isnan(a).all()


# ---- float16 / bfloat16 conversions, exhaustively ---------------------------

ADDENDS = [0.0, -0.0, 1.0, -1.0, 2.0**-11, -(2.0**-11), 3 * 2.0**-12, 2.0**-24, 2.0**-25,
           -(2.0**-25), 3 * 2.0**-26, 2.0**-14, 2.0**-15, 0.1, 1e-3, 7.0, 1000.0, 65504.0,
           -65504.0, 30000.0, np.inf, -np.inf, np.nan, 2.0**-8, 2.0**-9 + 2.0**-17]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_every_half_value_plus_addends(level, dtype):
    """All 65536 bit patterns, each plus a set of values chosen to hit ties,
    subnormals, the overflow edge and nan/inf: every rounding path."""
    dt = dtype_from_name(dtype)
    every = np.arange(65536, dtype=np.uint16).view(dt)
    for addend in ADDENDS:
        b = np.full(every.shape, addend, dtype=np.float32).astype(dt)
        a = every.copy()
        want = reference_reduce(a, b, ReduceOp.SUM, 1.0)
        kernels.reduce_into(a, b, ReduceOp.SUM)
        assert_same(a, want)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_identity_keeps_bits(level, dtype):
    dt = dtype_from_name(dtype)
    bits = np.arange(65536, dtype=np.uint16)
    a = bits.copy().view(dt)
    kernels.reduce_into(a, np.ones_like(a), ReduceOp.PRODUCT)
    nan = np.isnan(bits.view(dt).astype(np.float32))
    np.testing.assert_array_equal(a.view(np.uint16)[~nan], bits[~nan])
    assert np.isnan(a[nan].astype(np.float32)).all()


def test_float16_rounding_examples(level):
    # 1 + 2**-11 is a tie: to even (1.0); 1 + 3*2**-11 ties up to 1 + 2**-9;
    # 65504 + 16 = 65520 ties to even, which is infinity; 65504 + 15.99 stays
    a = np.array([1.0, 1.0 + 2.0**-10, 65504.0, 65504.0, 2.0**-24, 2.0**-24], dtype=np.float16)
    b = np.array([2.0**-11, 2.0**-11, 16.0, 15.99, 0.0, -(2.0**-24)], dtype=np.float32)
    b16 = b.astype(np.float16)
    kernels.reduce_into(a, b16, ReduceOp.SUM)
    assert a.astype(np.float64).tolist() == [1.0, 1.0 + 2.0**-9, np.inf, 65504.0, 2.0**-24, 0.0]


# ---- hl_scale ---------------------------------------------------------------

@pytest.mark.parametrize("n", [0, 1, 1000, 100003])
@pytest.mark.parametrize("factor", [1.0, 0.25, -3.0])
@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_matches_numpy(level, dtype, factor, n):
    src = make(dtype, n, 5)
    with np.errstate(all="ignore"):
        want = np_scale(src.astype(compute_dtype(src.dtype)), factor, src.dtype)
    dst = np.empty_like(src)
    kernels.scale_into(dst, src, factor)
    assert_same(dst, want)
    kernels.scale_into(src, src, factor)  # in place
    assert_same(src, want)


# ---- pack / unpack ------------------------------------------------------------

def mixed_arrays():
    rng = np.random.default_rng(7)
    return [rng.standard_normal(5).astype(np.float32), np.zeros(0, np.float32),
            np.arange(12, dtype=np.float32).reshape(3, 4), np.array(2.5, np.float32),
            np.zeros((0, 3), np.float32), rng.standard_normal(10007).astype(np.float32)]


def test_pack_unpack_roundtrip_mixed_dtypes():
    arrays = [np.arange(5, dtype=np.int64), np.zeros(0, np.float16), np.array([True, False]),
              np.arange(7, dtype=np.uint8), np.ones((2, 3), BF16), np.array(7, np.int32)]
    total = sum(a.nbytes for a in arrays)
    buf = np.full(total + 16, 0xAB, dtype=np.uint8)
    assert kernels.pack(buf, arrays) == total
    want = np.concatenate([a.reshape(-1).view(np.uint8) for a in arrays])
    np.testing.assert_array_equal(buf[:total], want)
    assert (buf[total:] == 0xAB).all()  # nothing written past the end
    outs = [np.empty_like(a) for a in arrays]
    kernels.unpack(buf, outs)
    for got, a in zip(outs, arrays):
        assert got.shape == a.shape
        np.testing.assert_array_equal(got.reshape(-1).view(np.uint8), a.reshape(-1).view(np.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("factor", [1.0, 0.5, -3.0])
def test_pack_scales_while_copying(level, dtype, factor):
    arrays = [make(dtype, n, seed) for seed, n in enumerate([3, 0, 1000, 1, 0, 4099])]
    arrays[2] = arrays[2].reshape(10, 100)
    total = sum(a.nbytes for a in arrays)
    buf = np.full(total + 8, 0xCD, dtype=np.uint8)
    assert kernels.pack(buf, arrays, factor) == total
    assert (buf[total:] == 0xCD).all()
    dt = arrays[0].dtype
    with np.errstate(all="ignore"):
        want = [np_scale(a.reshape(-1).astype(compute_dtype(dt)), factor, dt) for a in arrays]
    assert_same(buf[:total].view(dt), np.concatenate(want))
    outs = [np.empty_like(a) for a in arrays]
    kernels.unpack(buf, outs)
    for got, w, a in zip(outs, want, arrays):
        assert got.shape == a.shape
        assert_same(got.reshape(-1), w)


def test_pack_past_the_streaming_size_is_exact_at_every_offset():
    # From 8 MiB in all, packing writes with non-temporal stores: members of odd sizes
    # land at every alignment (heads and tails copied plainly), nothing past the end.
    rng = np.random.default_rng(5)
    sizes = [3, 255, 256, 257, 4 << 20, 1, 63, 65, (4 << 20) + 13, 0, 1000]
    arrays = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    total = sum(sizes)
    assert total >= 8 << 20
    for shift in (0, 1, 8, 15):
        buf = np.full(total + shift + 64, 0xEE, dtype=np.uint8)
        assert kernels.pack(buf[shift:], arrays) == total
        np.testing.assert_array_equal(buf[shift:shift + total], np.concatenate(arrays))
        assert (buf[:shift] == 0xEE).all() and (buf[shift + total:] == 0xEE).all()


def test_pack_nothing():
    buf = np.zeros(4, np.uint8)
    assert kernels.pack(buf, []) == 0
    assert kernels.pack(buf, [], 0.5) == 0
    kernels.unpack(buf, [])


def test_pack_many_arrays_in_one_call():
    arrays = mixed_arrays() * 50  # 300 arrays in one C call
    total = sum(a.nbytes for a in arrays)
    buf = np.empty(total, np.uint8)
    assert kernels.pack(buf, arrays, 0.5) == total
    outs = [np.empty_like(a) for a in arrays]
    kernels.unpack(buf, outs)
    for got, a in zip(outs, arrays):
        np.testing.assert_array_equal(got, a * np.float32(0.5))


# ---- errors -------------------------------------------------------------------

def test_reduce_errors():
    a = np.zeros(10, np.float32)
    with pytest.raises(ValueError, match="C-contiguous"):
        kernels.reduce_into(a[::2], np.zeros(5, np.float32), ReduceOp.SUM)
    with pytest.raises(ValueError, match="C-contiguous"):
        kernels.reduce_into(np.zeros(5, np.float32), a[::2], ReduceOp.SUM)
    with pytest.raises(ValueError, match="C-contiguous"):
        kernels.reduce_into(np.zeros((3, 4), np.float32).T, np.zeros((4, 3), np.float32),
                            ReduceOp.SUM)
    with pytest.raises(ValueError, match="elements"):
        kernels.reduce_into(a, np.zeros(9, np.float32), ReduceOp.SUM)
    with pytest.raises(TypeError, match="float64"):
        kernels.reduce_into(a, np.zeros(10, np.float64), ReduceOp.SUM)
    with pytest.raises(ValueError, match="op"):
        kernels.reduce_into(a, a.copy(), ReduceOp.ADASUM)
    with pytest.raises(ValueError, match="op"):
        kernels.reduce_into(a, a.copy(), 99)
    ro = np.zeros(10, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        kernels.reduce_into(ro, a, ReduceOp.SUM)
    kernels.reduce_into(a, ro, ReduceOp.SUM)  # a read-only source is fine


@pytest.mark.parametrize("dtype", [np.bool_, np.uint32, np.uint64,
                                   np.complex64, np.dtype(">f4"), np.dtype(">i4"), object])
def test_unsupported_dtypes(dtype):
    a = np.zeros(4, dtype=dtype)
    with pytest.raises(TypeError, match="unsupported dtype"):
        kernels.reduce_into(a, a.copy(), ReduceOp.SUM)
    with pytest.raises(TypeError, match="unsupported dtype"):
        kernels.scale_into(a, a, 2.0)


def test_scale_errors():
    with pytest.raises(ValueError, match="elements"):
        kernels.scale_into(np.zeros(3), np.zeros(4), 2.0)
    with pytest.raises(TypeError, match="int32"):
        kernels.scale_into(np.zeros(3), np.zeros(3, np.int32), 2.0)
    with pytest.raises(ValueError, match="C-contiguous"):
        kernels.scale_into(np.zeros(3), np.zeros(6)[::2], 2.0)


def test_pack_unpack_errors():
    buf = np.zeros(16, np.uint8)
    with pytest.raises(ValueError, match="need 20 bytes"):
        kernels.pack(buf, [np.zeros(5, np.float32)])
    with pytest.raises(ValueError, match="need 20 bytes"):
        kernels.unpack(buf, [np.zeros(5, np.float32)])
    with pytest.raises(ValueError, match=r"arrays\[1\].*C-contiguous"):
        kernels.pack(buf, [np.zeros(1), np.zeros(4, np.int8)[::2]])
    with pytest.raises(TypeError, match="one dtype"):
        kernels.pack(buf, [np.zeros(1, np.float32), np.zeros(1, np.int32)], 0.5)
    with pytest.raises(TypeError, match="unsupported dtype"):
        kernels.pack(buf, [np.zeros(2, np.bool_)], 0.5)
    ro = np.zeros(2, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        kernels.unpack(buf, [ro])
    with pytest.raises(ValueError, match="buffer"):
        kernels.pack(np.zeros(32, np.uint8)[::2], [np.zeros(1, np.float32)])
    assert (buf == 0).all()


def test_c_entry_points_reject_bad_codes_without_writing():
    a = np.ones(4, np.float32)
    pa, pb = ffi.from_buffer(a), ffi.from_buffer(np.ones(4, np.float32))
    assert lib.hl_reduce(pa, pb, 4, 10, 1, 1.0) == -1
    assert lib.hl_reduce(pa, pb, 4, -1, 1, 1.0) == -1
    assert lib.hl_reduce(pa, pb, 4, 6, 0, 1.0) == -2  # AVERAGE is folded by the caller
    assert lib.hl_reduce(pa, pb, 4, 6, 2, 1.0) == -2  # ADASUM
    assert lib.hl_scale(pa, pb, 4, 11, 2.0) == -1
    assert lib.hl_reduce(pa, pb, 4, 2, 1, float("nan")) == -4
    np.testing.assert_array_equal(a, 1)
    # a byte count that is not a whole number of elements: nothing is copied
    dst = np.zeros(16, np.uint8)
    srcs = ffi.new("void *[]", [pb, pb])
    sizes = ffi.new("size_t[]", [8, 6])
    assert lib.hl_pack(ffi.from_buffer(dst), srcs, sizes, 2, 6, 0.5) == -3
    assert (dst == 0).all()
    assert lib.hl_pack(ffi.from_buffer(dst), srcs, sizes, 2, 6, 1.0) == 0  # plain bytes
    one = np.ones(4, np.float32).view(np.uint8)
    np.testing.assert_array_equal(dst[:14], np.concatenate([one[:8], one[:6]]))
    assert (dst[14:] == 0).all()


def test_isa_levels():
    assert lib.hl_isa_name(0) != ffi.NULL
    assert lib.hl_isa_get() == LEVELS[-1]  # the best one is chosen at load time
    assert lib.hl_isa_set(-1) == -1
    assert lib.hl_isa_set(99) == -1
    assert lib.hl_isa_name(99) == ffi.NULL


@pytest.mark.parametrize("dtype", ["float32", "int64", "bfloat16", "float16"])
def test_pack_into_flat_mixed_strided_and_scaled(dtype):
    # 1-d arrays (NumPy's concatenate, a strided one included), arrays of other
    # dimensions in between (the native pack), and a scale factor (the native pack).
    dt = dtype_from_name(dtype)
    rng = np.random.RandomState(3)

    def arr(shape):
        return rng.randint(0, 9, size=shape).astype(np.float64).astype(dt)

    strided = arr((20,))[::2]
    cases = [([arr((5,)), strided, arr((1,)), arr((0,))], 1.0),
             ([arr((3,)), arr((2, 3)), arr((4,))], 1.0),
             ([arr(()), arr((3,))], 1.0),
             ([arr((5,)), arr((7,))], 2.0)]
    for arrays, factor in cases:
        flat = np.full(sum(a.size for a in arrays), 99, dtype=dt)
        kernels.pack_into(flat, [np.ascontiguousarray(a) if a.ndim != 1 else a for a in arrays], factor)
        want = np.concatenate([a.reshape(-1).astype(np.float64) for a in arrays]) * factor
        np.testing.assert_array_equal(flat.astype(np.float64), want)
