"""Grouped collectives: many tensors travelling as one.

A grouped allreduce of host arrays of one dtype is packed into one buffer (one
negotiation, one cache entry) with each member starting on a 64-byte boundary, so
the results are aligned views TensorFlow takes without a copy; the members of
any other group go separately under one handle.
"""
from __future__ import annotations

import math
import threading
from functools import lru_cache
from typing import List

import numpy as np

from ..core import kernels
from ..errors import InvalidCollectiveError
from ..execution.output_pool import OutputPool
from ..core.handle import Handle
from ..core.messages import Kind
from ..core.ops import REDUCIBLE_DTYPES, dtype_name
from .process_sets import SetHandle

__all__ = ["one_handle", "pack_host_group", "split_group"]


def one_handle(name: str, children: List[Handle], rt=None) -> Handle:
    """A handle done when all `children` are: their results as a list, or the first error."""
    group = SetHandle(name, None, rt.set_label) if rt is not None and rt.set_label else Handle(name)
    if not children:
        group._set_result([])
        return group
    remaining = [len(children)]
    lock = threading.Lock()

    def child_done(_):
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        errors = [c.exception() for c in children if c.exception() is not None]
        if any(c.first_dims is not None for c in children):  # allgathers
            group.first_dims = [c.first_dims for c in children]
        if errors:
            group._set_exception(errors[0])
        else:
            group._set_result([c.result() for c in children])

    for child in children:
        child.add_done_callback(child_done)
    return group


# Packed groups: where each member starts, and the buffers packing reuses.
_GROUP_ALIGN = 64  # bytes: TensorFlow copies a NumPy result that is not this aligned
_group_buffers = OutputPool()  # (a fresh buffer of many MiB per step costs its page faults)
_group_buffers_lock = threading.Lock()
_zeros = {}  # dtype -> _GROUP_ALIGN zero bytes, the padding between members
# Groups from this size on are reduced into the runtime's output pool: through shared
# memory their members are read where they lie (no pack), elsewhere packed there and
# reduced in place. Below it one np.concatenate into a buffer of this module's costs
# less than a list of parts (200 x 4 KiB: Python per member outweighs the copy).
IN_PLACE_MIN_BYTES = 4 << 20


def pack_host_group(arrays: list, base: str, pool=None, read_in_place: bool = False):
    """(one flat array, the shapes, whether it is from `pool`, the parts) for NumPy
    arrays of one reducible dtype, else None.

    The common case of a grouped step (hundreds of small gradients) takes one
    pass here: per-array checks cost more than copying 4 KiB. `pool`: the runtime's
    output pool (execution/output_pool.py), whose buffer the runtime then reduces in
    place and hands back as the result, for groups of IN_PLACE_MIN_BYTES or more;
    smaller ones go into a pool of this module's. read_in_place (the runtime reads a
    fused batch's members where they lie: through shared memory): a group from `pool`
    is not packed at all; the parts (its members and the padding between them, 1-D)
    are returned instead, for the runtime to reduce into the still empty flat array.
    Otherwise parts is None.
    """
    if not arrays:
        return None
    dtype = getattr(arrays[0], "dtype", None)
    for a in arrays:
        if a.__class__ is not np.ndarray or a.dtype != dtype:
            return None
    if not dtype.isnative:
        return None  # converted member by member first
    dname = dtype_name(dtype)
    if dname not in REDUCIBLE_DTYPES:
        raise InvalidCollectiveError(
            f"tensor '{base}.0': dtype {dname} is not supported by "
            f"{Kind.ALLREDUCE.label}; supported: {', '.join(REDUCIBLE_DTYPES)}")
    shapes = tuple([a.shape for a in arrays])
    total, gaps = _layout(shapes, dtype.itemsize)[1:]
    owned = pool is not None and total * dtype.itemsize >= IN_PLACE_MIN_BYTES
    if owned:
        flat = pool.empty((total,), dtype)
    else:
        with _group_buffers_lock:
            flat = _group_buffers.empty((total,), dtype)
    if gaps:
        # the padding travels too, as zeros (reduced, it stays zero)
        pad = _zeros.get(dtype)
        if pad is None:
            pad = _zeros[dtype] = np.zeros(_GROUP_ALIGN // dtype.itemsize, dtype)
        parts = []
        for a, gap in zip(arrays, gaps):
            parts.append(a)
            if gap:
                parts.append(pad[:gap])
    else:
        parts = arrays
    if owned and read_in_place:
        return flat, shapes, owned, [(a if a.flags.c_contiguous else a.copy(order="C")).reshape(-1)
                                     for a in parts]
    try:
        kernels.pack_into(flat, parts)
    except ValueError:  # a non-contiguous member: copy those first
        parts = [a if a.flags.c_contiguous else a.copy(order="C") for a in parts]
        kernels.pack_into(flat, parts)
    return flat, shapes, owned, None


@lru_cache(maxsize=256)
def _layout(shapes, itemsize: int) -> tuple:
    """(where each member sits in the flat buffer, its length in elements, the padding
    after each member in elements); a step repeats its shapes."""
    align = _GROUP_ALIGN // itemsize
    spans, gaps, offset = [], [], 0
    for k, shape in enumerate(shapes):
        n = math.prod(shape)
        spans.append((slice(offset, offset + n), None if len(shape) == 1 else shape))
        offset += n
        gap = -offset % align if k + 1 < len(shapes) else 0
        gaps.append(gap)
        offset += gap
    return tuple(spans), offset, tuple(gaps) if any(gaps) else ()


def split_group(flat: np.ndarray, shapes) -> List[np.ndarray]:
    return [flat[span] if shape is None else flat[span].reshape(shape)
            for span, shape in _layout(shapes, flat.itemsize)[0]]
