"""What the collectives ask of an array before it is submitted, for CuPy arrays too
(one process, no MPI, no GPU: CuPy's own Flags class where CuPy imports)."""
import numpy as np
import pytest

from horolite.api import collectives
from horolite.core import device
from horolite.core.messages import Kind


def cupy_flags(c_contiguous: bool):
    """CuPy's real ndarray.flags object (it has no `aligned`), or one shaped like it."""
    try:
        from cupy._core.flags import Flags
    except Exception:  # CuPy not installed: the same three attributes, and no `aligned`
        class Flags:
            def __init__(self, c, f, owndata):
                self.c_contiguous, self.f_contiguous, self.owndata = c, f, owndata
    flags = Flags(c_contiguous, not c_contiguous, True)
    assert not hasattr(flags, "aligned")
    return flags


class DeviceArrayLike:
    """Looks like a CuPy array where _as_array looks: device memory, dtype, shape, flags."""
    __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0, False), "version": 3}

    def __init__(self, c_contiguous=True):
        self.dtype, self.shape = np.dtype(np.float32), (4,)
        self.flags = cupy_flags(c_contiguous)
        self.copied = None

    def copy(self, order="K"):
        self.copied = order
        return DeviceArrayLike(True)


def test_numpy_needs_a_copy_when_strided_or_misaligned():
    assert not device.needs_contiguous_copy(np.ones(4))
    assert device.needs_contiguous_copy(np.ones(8)[::2])
    raw = np.zeros(4 * 4 + 1, np.uint8)[1:].view(np.float32)  # misaligned by one byte
    assert not raw.flags.aligned and device.needs_contiguous_copy(raw)


def test_cupy_flags_without_aligned_are_read():
    assert not device.needs_contiguous_copy(DeviceArrayLike(True))
    assert device.needs_contiguous_copy(DeviceArrayLike(False))


@pytest.mark.parametrize("contiguous", [True, False])
def test_as_array_takes_a_device_array(monkeypatch, contiguous):
    """The GPU path's check ('Flags' object has no attribute 'aligned' on every CuPy collective)."""
    given = DeviceArrayLike(contiguous)
    monkeypatch.setattr(collectives._device, "device_input", lambda obj, name, rt: obj)
    got = collectives._as_array(given, "t", Kind.ALLREDUCE, rt=object())
    assert isinstance(got, DeviceArrayLike)
    assert (got is given) == contiguous
    assert given.copied == (None if contiguous else "C")


class DeviceSplits:
    """Splits in device memory: refuses implicit host conversion, as CuPy does."""
    __cuda_array_interface__ = {"shape": (3,), "typestr": "<i8", "data": (0, False), "version": 3}

    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed")

    def get(self):
        return np.array([2, 0, 1], dtype=np.int64)


def test_alltoall_splits_in_device_memory_come_to_the_host():
    assert device.host_ints(DeviceSplits()).tolist() == [2, 0, 1]
    assert device.host_ints([[1], [2]]).tolist() == [1, 2]
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.asarray(DeviceSplits(), dtype=np.int64)  # what the old code did
