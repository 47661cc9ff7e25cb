"""The objects ranks exchange at set-up, as bytes, without pickle.

MPI's lowercase calls pickle what they carry; across horolite's own connections the
far end is a peer that proved it holds the job's key, but a bug or a stranger that
got past set-up must never run code here. So only plain data travels: None, bool,
int, float, str, bytes, lists, tuples, dicts and NumPy arrays and scalars; anything
else fails on the sending rank, naming its type.
"""
from __future__ import annotations

import struct
from typing import Any, Tuple

import numpy as np

__all__ = ["encode", "decode"]

_LEN = struct.Struct("<Q")
_INT = struct.Struct("<q")
_FLOAT = struct.Struct("<d")
_MAX_DEPTH = 64


def encode(obj: Any) -> bytes:
    out = bytearray()
    _put(obj, out, 0)
    return bytes(out)


def _put(obj: Any, out: bytearray, depth: int) -> None:
    if depth > _MAX_DEPTH:
        raise ValueError("an object nested more than %d deep" % _MAX_DEPTH)
    if obj is None:
        out += b"N"
    elif obj is True or obj is False:
        out += b"T" if obj else b"F"
    elif isinstance(obj, (int, np.integer)) and not isinstance(obj, np.bool_):
        value = int(obj)
        if -(1 << 63) <= value < (1 << 63):
            out += b"i" + _INT.pack(value)
        else:
            text = str(value).encode()
            out += b"I" + _LEN.pack(len(text)) + text
    elif isinstance(obj, np.bool_):
        out += b"T" if obj else b"F"
    elif isinstance(obj, (float, np.floating)):
        out += b"f" + _FLOAT.pack(float(obj))
    elif isinstance(obj, str):
        data = obj.encode("utf-8", "surrogatepass")
        out += b"s" + _LEN.pack(len(data)) + data
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        data = bytes(obj)
        out += b"b" + _LEN.pack(len(data)) + data
    elif isinstance(obj, (list, tuple)):
        out += (b"l" if isinstance(obj, list) else b"t") + _LEN.pack(len(obj))
        for item in obj:
            _put(item, out, depth + 1)
    elif isinstance(obj, dict):
        out += b"d" + _LEN.pack(len(obj))
        for k, v in obj.items():
            _put(k, out, depth + 1)
            _put(v, out, depth + 1)
    elif isinstance(obj, np.ndarray) and obj.dtype.kind in "biufc":
        dtype = obj.dtype.str.encode()
        data = np.ascontiguousarray(obj).tobytes()
        out += b"a" + _LEN.pack(len(dtype)) + dtype + _LEN.pack(obj.ndim)
        for n in obj.shape:
            out += _LEN.pack(n)
        out += _LEN.pack(len(data)) + data
    else:
        raise TypeError(f"cannot send a {type(obj).__name__} between ranks (plain data only: "
                        "None, bool, int, float, str, bytes, list, tuple, dict, NumPy arrays)")


def decode(data: bytes) -> Any:
    view = memoryview(data)
    obj, end = _get(view, 0, 0)
    if end != len(view):
        raise ValueError(f"{len(view) - end} bytes left after the object")
    return obj


def _take(view: memoryview, at: int, n: int) -> Tuple[memoryview, int]:
    if n < 0 or at + n > len(view):
        raise ValueError("truncated")
    return view[at:at + n], at + n


def _length(view: memoryview, at: int) -> Tuple[int, int]:
    raw, at = _take(view, at, _LEN.size)
    return _LEN.unpack(raw)[0], at


def _get(view: memoryview, at: int, depth: int) -> Tuple[Any, int]:
    if depth > _MAX_DEPTH:
        raise ValueError("nested too deep")
    tag, at = _take(view, at, 1)
    tag = bytes(tag)
    if tag == b"N":
        return None, at
    if tag in (b"T", b"F"):
        return tag == b"T", at
    if tag == b"i":
        raw, at = _take(view, at, _INT.size)
        return _INT.unpack(raw)[0], at
    if tag == b"f":
        raw, at = _take(view, at, _FLOAT.size)
        return _FLOAT.unpack(raw)[0], at
    if tag in (b"I", b"s", b"b"):
        n, at = _length(view, at)
        raw, at = _take(view, at, n)
        if tag == b"b":
            return bytes(raw), at
        text = bytes(raw).decode("utf-8", "surrogatepass")
        return (int(text) if tag == b"I" else text), at
    if tag in (b"l", b"t"):
        n, at = _length(view, at)
        items = []
        for _ in range(n):
            item, at = _get(view, at, depth + 1)
            items.append(item)
        return (items if tag == b"l" else tuple(items)), at
    if tag == b"d":
        n, at = _length(view, at)
        out = {}
        for _ in range(n):
            k, at = _get(view, at, depth + 1)
            v, at = _get(view, at, depth + 1)
            out[k] = v
        return out, at
    if tag == b"a":
        n, at = _length(view, at)
        raw, at = _take(view, at, n)
        dtype = np.dtype(bytes(raw).decode("ascii"))
        if dtype.kind not in "biufc":
            raise ValueError(f"array of dtype {dtype}")
        ndim, at = _length(view, at)
        if ndim > 32:
            raise ValueError("an array of %d dimensions" % ndim)
        shape = []
        for _ in range(ndim):
            dim, at = _length(view, at)
            shape.append(dim)
        n, at = _length(view, at)
        raw, at = _take(view, at, n)
        return np.frombuffer(bytes(raw), dtype=dtype).reshape(shape), at
    raise ValueError(f"unknown tag {tag!r}")
