"""Device arrays through host memory, for jobs where NCCL is off.

NCCL is off for the whole job when some rank has no GPU, NCCL does not load,
or ranks share a GPU (transport/nccl.py `decide_nccl`). A device array is then
copied into pinned host memory on the caller's thread (on its current stream,
so work the caller queued before is included), reduced on the host path
(shared memory or the ring, like any NumPy array), and the result is copied
back onto the GPU the array came from before its handle completes. One
warning per process says why.

Speed: two copies over PCIe per collective on top of the host path's time;
when every rank has its own GPU, NCCL is used instead.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Optional, Tuple

import numpy as np

__all__ = ["NCCL", "STAGED", "device_route", "to_pinned_host", "to_device", "returning_on",
           "warn_once"]

_log = logging.getLogger("horolite.core.staging")

NCCL, STAGED = "nccl", "staged"


def device_route(nccl_up: bool, reason: str) -> Tuple[str, str]:
    """(NCCL or STAGED, why) for a device array on this job. Pure."""
    if nccl_up:
        return NCCL, reason
    return STAGED, f"NCCL is off for this job ({reason})"


def to_pinned_host(array) -> np.ndarray:
    """A NumPy copy of CuPy `array` in pinned host memory, complete when this returns."""
    import cupy
    import cupyx
    host = cupyx.empty_pinned(array.shape, array.dtype)
    with cupy.cuda.Device(array.device.id):
        array.get(out=host)  # blocking, on the caller's current stream
    return host


def to_device(result, device_id: int):
    """The host `result` as a CuPy array on `device_id`, complete when this returns."""
    import cupy
    with cupy.cuda.Device(device_id):
        out = cupy.asarray(result)  # (np.ascontiguousarray would make a 0-d result 1-d)
        # A copy from pageable memory may still be in flight when the call returns;
        # the caller may use the result on any stream.
        cupy.cuda.get_current_stream().synchronize()
    return out


def returning_on(device_id: int, transform: Optional[Callable] = None) -> Callable:
    """A handle transform: `transform`'s result with its data arrays back on `device_id`.

    Collectives return an array, a list of arrays, or (rows, splits) from alltoall
    with splits, whose splits stay host metadata as on the NCCL path.
    """
    def back(result):
        if transform is not None:
            result = transform(result)
        if isinstance(result, np.ndarray):
            return to_device(result, device_id)
        if isinstance(result, tuple) and len(result) == 2:
            return to_device(result[0], device_id), result[1]
        if isinstance(result, list):
            return [to_device(r, device_id) for r in result]
        return result
    return back


_warned = threading.Event()


def warn_once(why: str) -> None:
    if not _warned.is_set():
        _warned.set()
        _log.warning("device arrays are staged through host memory: %s; NCCL runs when every "
                     "rank has its own GPU", why)
