"""What a device array is, which GPU a rank uses, and whether NCCL can run here.

Nothing in this module imports CuPy at import time, and nothing imports it for
host arrays: `import horolite` and the host path work whether CuPy is missing,
installed without a driver, or fully working. CuPy is imported the first time
something actually needs it (a device array is submitted, or `nccl_status()`
finds a CUDA driver with at least one device).

Device arrays are objects with ``__cuda_array_interface__`` (CuPy, Numba,
PyTorch CUDA tensors...) or DLPack objects whose ``__dlpack_device__`` is a
CUDA device (TensorFlow GPU tensors...). They travel as CuPy views of the same
memory: no host copy.

Device selection (documented in docs/gpus.md): every rank uses one GPU,
an ordinal among the devices it can see (so ``CUDA_VISIBLE_DEVICES`` narrows
and renumbers them as usual):

* ``HOROLITE_GPU_DEVICE`` unset: ``local_rank % visible_device_count``. With a
  scheduler that gives each rank a single visible device this is device 0.
* ``HOROLITE_GPU_DEVICE=N``: device N, whatever the local rank.
* ``HOROLITE_GPU_DEVICE=2,3``: entry ``local_rank % 2`` of the list.

The ``HOROVOD_GPU_DEVICE`` spelling is accepted too.
"""
from __future__ import annotations

import ctypes
import importlib.util
import itertools
import threading
from typing import Optional, Sequence, Tuple

import numpy as np

from .config import env_value
from ..errors import InvalidCollectiveError

__all__ = ["CPU", "CUDA", "is_device_array", "device_kind", "device_string", "as_cupy",
           "device_input", "Ready", "record_ready", "last_ready", "needs_contiguous_copy", "host_ints", "select_device", "device_for_rank", "parse_device_override", "nccl_status", "cuda_device_count"]

CPU = "cpu"
CUDA = "cuda"

# DLPack device types that are CUDA device memory (kDLCUDA, kDLCUDAManaged).
# kDLCUDAHost (3) is pinned host memory: NumPy can read it, it is not a device array.
_DLPACK_CUDA = (2, 13)


# ---- what is a device array ----
def _dlpack_device(obj) -> Optional[Tuple[int, int]]:
    fn = getattr(obj, "__dlpack_device__", None)
    if fn is None:
        return None
    try:
        kind, index = fn()
        return int(kind), int(index)
    except Exception:  # an object that claims DLPack but cannot say where it lives
        return None


def is_device_array(obj) -> bool:
    """True for CUDA device memory (CUDA array interface, or DLPack on a CUDA device).

    Cheap, and never imports CuPy: NumPy arrays answer False at once.
    """
    if isinstance(obj, np.ndarray) or obj is None:
        return False
    try:
        # (a property on some types, e.g. raising for CPU tensors: any error means "no")
        getattr(obj, "__cuda_array_interface__")
        return True
    except Exception:
        pass
    dev = _dlpack_device(obj)
    return dev is not None and dev[0] in _DLPACK_CUDA


def device_kind(obj) -> str:
    """The device string negotiation compares: "cpu" or "cuda".

    It is the kind, not "cuda:N": ranks on one host use different GPUs, and that
    is no mismatch. The GPU a rank uses is a local matter (see select_device).
    """
    return CUDA if is_device_array(obj) else CPU


def device_string(obj) -> str:
    """Where an array lives, for messages: "cpu" or "cuda:N"."""
    if not is_device_array(obj):
        return CPU
    dev = getattr(obj, "device", None)
    index = getattr(dev, "id", None)
    if index is None:
        d = _dlpack_device(obj)
        index = d[1] if d is not None else "?"
    return f"{CUDA}:{index}"


def _cupy():
    try:
        import cupy
    except Exception as exc:  # ImportError, or a CuPy broken at import
        raise InvalidCollectiveError(
            f"a CUDA array was given but CuPy cannot be imported ({exc}); install horolite's "
            "`cuda` extra (cupy-cuda12x, nvidia-nccl-cu12)") from None
    return cupy


def as_cupy(obj):
    """A CuPy view of a device array (same memory, no copy)."""
    cupy = _cupy()
    if isinstance(obj, cupy.ndarray):
        return obj
    try:
        getattr(obj, "__cuda_array_interface__")
    except Exception:
        return _from_dlpack(cupy, obj)
    return cupy.asarray(obj)


def _from_dlpack(cupy, obj):
    try:
        # The protocol's stream handshake: the producer orders its work before CuPy's stream.
        return cupy.from_dlpack(obj)
    except (RuntimeError, TypeError, BufferError):
        # Producers that refuse the handshake (TensorFlow: "does not support DLPack export
        # with a non-None stream"): take the plain capsule and wait for the whole device.
        array = cupy.from_dlpack(obj.__dlpack__())
        if array.nbytes:
            # TensorFlow writes its own (logical) GPU index into the capsule: ask the
            # driver which device the memory is really on (tf_dlpack.py says why).
            actual = cupy.cuda.runtime.pointerGetAttributes(array.data.ptr).device
            if actual != array.device.id:
                array = relabelled(cupy, array, actual)
        with array.device:
            cupy.cuda.runtime.deviceSynchronize()
        return array


def relabelled(cupy, array, device_id: int):
    """A view of `array`'s memory that says it is on `device_id` (keeps `array` alive).

    For DLPack producers whose device id is not the CUDA ordinal (TensorFlow's
    logical GPU index), in either direction.
    """
    memory = cupy.cuda.UnownedMemory(array.data.ptr, array.nbytes, array, device_id)
    return cupy.ndarray(array.shape, array.dtype, cupy.cuda.MemoryPointer(memory, 0),
                        strides=array.strides)


def device_input(obj, name: str, rt):
    """The CuPy array a collective works on, after checking it can go over NCCL on this rank.

    `rt` is the Runtime: its `nccl` transport says which device this rank uses;
    when it is None (NCCL off, the reason in `nccl_reason`) any device will do,
    as the array is then staged through host memory.
    """
    transport = getattr(rt, "nccl", None)
    array = as_cupy(obj)
    if transport is None:
        # NCCL is off for the job: the collective stages it through host memory (staging.py).
        pass
    elif array.device.id != transport.device_id:
        raise InvalidCollectiveError(
            f"tensor '{name}' is on cuda:{array.device.id} but this rank's NCCL communicator "
            f"uses cuda:{transport.device_id} (chosen from the local rank, or by "
            "HOROLITE_GPU_DEVICE): move the tensor there")
    if not array.flags.c_contiguous:
        with array.device:
            array = array.copy(order="C")
    return array


class Ready:
    """A CUDA event recorded on the caller's stream at submit: the array's data is complete
    when it fires. Events recorded later by one thread on one stream fire later, so a batch
    waits only for the last of each (`stream_key`, `seq`): one wait, not one per member."""
    __slots__ = ("event", "stream_key", "seq")

    def __init__(self, event, stream_key, seq: int):
        self.event, self.stream_key, self.seq = event, stream_key, seq


_ready_seq = itertools.count()


def record_ready(array) -> Ready:
    """A Ready on the caller's current stream for `array`'s device."""
    cupy = _cupy()
    with array.device:
        stream = cupy.cuda.get_current_stream()
        event = cupy.cuda.Event(block=False, disable_timing=True, interprocess=False)
        event.record(stream)
    return Ready(event, (array.device.id, stream.ptr, threading.get_ident()), next(_ready_seq))


def last_ready(readies) -> list:
    """The events a batch must wait for: the last Ready of each thread's stream (None skipped)."""
    last = {}
    for ready in readies:
        if ready is not None:
            have = last.get(ready.stream_key)
            if have is None or ready.seq > have.seq:
                last[ready.stream_key] = ready
    return [ready.event for ready in last.values()]


def needs_contiguous_copy(arr) -> bool:
    """Whether the kernels need a C-contiguous copy of `arr` (NumPy or CuPy).

    CuPy's flags have no `aligned` (its allocator hands out aligned device
    memory, and a view cannot be misaligned for its dtype): only contiguity is
    asked of a device array.
    """
    flags = arr.flags
    return not (flags.c_contiguous and getattr(flags, "aligned", True))


def host_ints(values) -> np.ndarray:
    """Integer metadata (alltoall's splits) as host int64, also from device memory (a CuPy
    array refuses np.asarray; TensorFlow GPU splits arrive as one)."""
    if is_device_array(values):
        values = (values if hasattr(values, "get") else as_cupy(values)).get()
    return np.asarray(values, dtype=np.int64).reshape(-1)


# ---- device selection ----
def parse_device_override(raw: Optional[str]) -> Optional[Tuple[int, ...]]:
    """HOROLITE_GPU_DEVICE: "" or None -> None; "1" -> (1,); "2,3" -> (2, 3)."""
    if raw is None or not raw.strip():
        return None
    try:
        devices = tuple(int(part) for part in raw.replace(" ", "").split(","))
    except ValueError:
        raise ValueError(f"HOROLITE_GPU_DEVICE={raw!r} is not a device ordinal or a "
                         "comma-separated list of them (e.g. 0 or 2,3)") from None
    if any(d < 0 for d in devices):
        raise ValueError(f"HOROLITE_GPU_DEVICE={raw!r}: device ordinals are >= 0")
    return devices


def select_device(local_rank: int, device_count: int,
                  override: Optional[Sequence[int]] = None) -> int:
    """The GPU ordinal (among the visible devices) this rank uses.

    Pure function: see the module docstring for the rule.
    """
    if device_count <= 0:
        raise ValueError("no CUDA device is visible to this process")
    if override:
        device = override[local_rank % len(override)]
        if device >= device_count:
            raise ValueError(f"HOROLITE_GPU_DEVICE asks for device {device} but this process "
                             f"sees {device_count} (ordinals 0..{device_count - 1}; "
                             "CUDA_VISIBLE_DEVICES renumbers them)")
        return device
    return local_rank % device_count


def device_for_rank(local_rank: int, device_count: int) -> int:
    """select_device with the override read from the environment."""
    return select_device(local_rank, device_count,
                         parse_device_override(env_value("GPU_DEVICE")))


# ---- is NCCL usable here ----
_status_lock = threading.Lock()
_status: Optional[Tuple[bool, str]] = None
_device_count: Optional[int] = None


def _driver_device_count() -> Tuple[int, str]:
    """Ask the CUDA driver (through ctypes, without CuPy) how many devices it sees."""
    lib = None
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll", "libcuda.dylib"):
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    if lib is None:
        return 0, "no driver (libcuda.so.1 not found)"
    rc = lib.cuInit(0)
    if rc != 0:
        return 0, f"no driver usable (cuInit returned CUDA error {rc})"
    count = ctypes.c_int(0)
    rc = lib.cuDeviceGetCount(ctypes.byref(count))
    if rc != 0:
        return 0, f"no driver usable (cuDeviceGetCount returned CUDA error {rc})"
    if count.value == 0:
        return 0, "0 devices"
    return count.value, ""


def _probe() -> Tuple[bool, str, int]:
    if importlib.util.find_spec("cupy") is None:
        return False, "no CUDA device: cupy not installed", 0
    count, why = _driver_device_count()
    if count == 0:
        return False, f"no CUDA device: {why}", 0
    try:
        import cupy
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return False, f"no CUDA device: cupy cannot use the driver ({exc})", 0
    if count == 0:
        return False, "no CUDA device: 0 devices", 0
    try:
        from cupy.cuda import nccl
        if not getattr(nccl, "available", False):
            return False, f"{count} CUDA device(s) but NCCL does not load (install nvidia-nccl-cu12)", count
        version = nccl.get_version()
    except Exception as exc:
        return False, f"{count} CUDA device(s) but NCCL does not load ({exc})", count
    major, minor, patch = version // 10000, version // 100 % 100, version % 100
    if version < 10000:  # NCCL 2.8 and older encode x.y.z as x*1000 + y*100 + z
        major, minor, patch = version // 1000, version // 100 % 10, version % 100
    try:
        built = cupy.cuda.runtime.runtimeGetVersion()
        built = f" (CUDA {built // 1000}.{built % 1000 // 10})"
    except Exception:  # a CuPy without the runtime call: the wheel's name says it (cuda_info)
        built = ""
    return True, (f"NCCL {major}.{minor}.{patch} with {count} CUDA device(s), "
                  f"CuPy {cupy.__version__}{built}"), count


def nccl_status() -> Tuple[bool, str]:
    """(available, reason): NCCL is available when CuPy imports, a GPU is present and NCCL loads.

    The reason says what is missing ("no CUDA device: cupy not installed",
    "no CUDA device: no driver (...)", "no CUDA device: 0 devices", "... NCCL
    does not load ...") or, when available, which NCCL and how many devices.
    CuPy is imported only once a driver with a device has been found. The
    answer is computed once per process.
    """
    global _status, _device_count
    with _status_lock:
        if _status is None:
            ok, reason, count = _probe()
            _status, _device_count = (ok, reason), count
        return _status


def cuda_device_count() -> int:
    """Visible CUDA devices (0 when there is no usable driver or no CuPy)."""
    nccl_status()
    return _device_count or 0
