"""Reduction, scaling and fusion-buffer packing kernels.

The interface the ring and fusion code call, backed by the C kernels in
``native/`` (compiled by cffi into ``horolite._native``). There is no NumPy
fallback: the extension is part of the package.

Arrays are NumPy arrays, C-contiguous, of any shape (they are treated as flat).
Reductions and scaling take the dtypes in ``ops.REDUCIBLE_DTYPES`` (bfloat16 is
``ml_dtypes.bfloat16``); float16 and bfloat16 compute in float32 and round to
nearest even. Integer sum and product wrap around; a scaled integer is computed
in double, truncated toward zero and saturated to the dtype's range.
"""
from __future__ import annotations

import numpy as np

from .ops import REDUCIBLE_DTYPES, ReduceOp

try:
    from .._native import ffi as _ffi, lib as _lib
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        "horolite._native (the compiled kernels) is missing or broken: reinstall "
        "horolite with `pip install .` (or `pip install -e .`), or in a source "
        "checkout build it in place with `python native/build_native.py`") from exc

__all__ = ["reduce_into", "scale_into", "pack", "unpack", "native_codes", "check"]

# AVERAGE reduces like SUM: the caller folds 1/n into postscale.
_OP_CODES = {ReduceOp.SUM: 1, ReduceOp.AVERAGE: 1, ReduceOp.MIN: 3,
             ReduceOp.MAX: 4, ReduceOp.PRODUCT: 5}
_ITEMSIZE = {"uint8": 1, "int8": 1, "int32": 4, "int64": 8,
             "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "uint16": 2, "int16": 2}
_ERRORS = {-1: "unsupported dtype", -2: "unsupported reduce op",
           -3: "byte count is not a multiple of the element size",
           -4: "integer dtypes need a finite scale factor"}

# dtype -> native code, filled on first sight of each dtype
_codes: dict = {}
# Resolved once: cffi parses C type strings and keyword arguments on every
# call otherwise, which costs more than the small kernels themselves.
_from_buffer = _ffi.from_buffer
_new = _ffi.new
_CHARS = _ffi.typeof("char[]")
_PTRS = _ffi.typeof("void *[]")
_SIZES = _ffi.typeof("size_t[]")


def _code(dtype: np.dtype) -> int:
    code = _codes.get(dtype)
    if code is None:
        name = dtype.name
        if (name not in REDUCIBLE_DTYPES or not dtype.isnative
                or dtype.itemsize != _ITEMSIZE[name]):
            raise TypeError(f"unsupported dtype {dtype} for reduction or scaling: "
                            f"use one of {', '.join(REDUCIBLE_DTYPES)} in native byte order")
        code = _codes[dtype] = REDUCIBLE_DTYPES[name]
    return code


def _buf(array: np.ndarray, what: str, writable: bool = False):
    """A cffi pointer to the array's data (which it keeps alive)."""
    try:
        return _from_buffer(_CHARS, array, writable)
    except (ValueError, TypeError, BufferError) as exc:
        if not isinstance(array, np.ndarray):
            raise TypeError(f"{what} must be a NumPy array, not {type(array).__name__}") from None
        if not array.flags.c_contiguous:
            raise ValueError(f"{what} must be C-contiguous") from None
        if writable and not array.flags.writeable:
            raise ValueError(f"{what} must be writable") from None
        raise ValueError(f"{what}: {exc}") from None


def check(rc: int) -> None:
    """Raise for a native kernel's negative return code."""
    if rc:
        raise ValueError(f"native kernel failed: {_ERRORS.get(rc, f'error {rc}')}")



def _op_code(op: ReduceOp) -> int:
    opc = _OP_CODES.get(op)
    if opc is None:
        raise ValueError(f"unsupported reduce op {op!r}: the kernels do "
                         "SUM, AVERAGE, MIN, MAX and PRODUCT")
    return opc


def native_codes(dtype: np.dtype, op: ReduceOp):
    """(dtype code, op code) for native code that reduces (native/shm_ring.c)."""
    return _code(dtype), _op_code(op)


def _same_kind(what: str, out_name: str, out: np.ndarray, src: np.ndarray):
    """(dtype code, element count) once `out` and `src` are checked to match."""
    code = _code(out.dtype)
    if src.dtype != out.dtype:
        raise TypeError(f"{what}: {out_name} is {out.dtype} but src is {src.dtype}")
    if src.size != out.size:
        raise ValueError(f"{what}: {out_name} has {out.size} elements but src has {src.size}")
    return code, out.size


def reduce_into(acc: np.ndarray, src: np.ndarray, op: ReduceOp, postscale: float = 1.0) -> None:
    """acc = (acc op src) * postscale, in one pass (AVERAGE reduces like SUM)."""
    code, count = _same_kind("reduce_into", "acc", acc, src)
    opc = _op_code(op)
    check(_lib.hl_reduce(_buf(acc, "acc", True), _buf(src, "src"), count, code, opc,
                          postscale))


def scale_into(dst: np.ndarray, src: np.ndarray, factor: float) -> None:
    """dst = src * factor (dst may be src)."""
    code, count = _same_kind("scale_into", "dst", dst, src)
    check(_lib.hl_scale(_buf(dst, "dst", True), _buf(src, "src"), count, code, factor))


def _pointers(arrays, what: str, writable: bool):
    """cffi buffers of every array (kept alive by the list), checked only on failure:
    a fused step packs hundreds of small arrays, so the common case stays lean."""
    try:
        return [_from_buffer(_CHARS, a, writable) for a in arrays]
    except (ValueError, TypeError, BufferError):
        for i, a in enumerate(arrays):
            _buf(a, f"{what}: arrays[{i}]", writable)
        raise


def pack(buffer: np.ndarray, arrays, factor: float = 1.0) -> int:
    """Copy `arrays` back to back into the uint8 `buffer`, scaled by `factor`
    (all arrays then share one reducible dtype); returns the bytes used."""
    keep = _pointers(arrays, "pack", False)
    sizes = [a.nbytes for a in arrays]
    total = sum(sizes)
    code = 0  # ignored by the C side for a plain copy
    if factor != 1.0 and arrays:
        dtype = arrays[0].dtype
        code = _code(dtype)
        for i, a in enumerate(arrays):
            if a.dtype != dtype:
                raise TypeError(f"pack with a scale factor needs one dtype: arrays[0] is "
                                f"{dtype}, arrays[{i}] is {a.dtype}")
    if total > buffer.nbytes:
        raise ValueError(f"pack: arrays need {total} bytes, buffer has {buffer.nbytes}")
    check(_lib.hl_pack(_buf(buffer, "buffer", True), _new(_PTRS, keep), _new(_SIZES, sizes),
                        len(keep), code, factor))
    return total


def pack_into(flat: np.ndarray, arrays, factor: float = 1.0) -> None:
    """pack() into the typed 1-d `flat`; when every array is 1-d and unscaled, through
    NumPy's concatenate, which needs no pointer per array (a step's many small
    gradients: 115 us against 202 us for 200 x 4 KiB)."""
    if factor == 1.0 and arrays and arrays[0].ndim == 1 == arrays[-1].ndim:
        try:
            np.concatenate(arrays, out=flat)
            return
        except ValueError:  # some array in between has other dimensions (a failed try: ~0.2 us each)
            pass
    pack(flat.view(np.uint8), arrays, factor)


def unpack(buffer: np.ndarray, arrays) -> None:
    """Copy consecutive bytes of the uint8 `buffer` into each array."""
    keep = _pointers(arrays, "unpack", True)
    sizes = [a.nbytes for a in arrays]
    total = sum(sizes)
    if total > buffer.nbytes:
        raise ValueError(f"unpack: arrays need {total} bytes, buffer has {buffer.nbytes}")
    check(_lib.hl_unpack(_new(_PTRS, keep), _buf(buffer, "buffer"), _new(_SIZES, sizes), len(keep)))
