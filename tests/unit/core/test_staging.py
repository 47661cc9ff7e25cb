"""Device arrays through host memory when NCCL is off (horolite/core/staging.py), without a
GPU: a fake `cupy`/`cupyx` (imported lazily) records which device was current for each copy.
Staging for real, at np 2-4 on one GPU, is in tests/parallel/test_gpu.py."""
import logging
import sys
import types

import numpy as np
import pytest

from horolite.api import collectives
from horolite.core import staging
from horolite.core.messages import Kind


class FakeCupyArray:
    def __init__(self, cp, data, device_id):
        self.cp, self.data_, self.device = cp, np.array(data), types.SimpleNamespace(id=device_id)
        self.shape, self.dtype = self.data_.shape, self.data_.dtype
        self.flags = types.SimpleNamespace(c_contiguous=True, f_contiguous=True, owndata=True)
        self.__cuda_array_interface__ = {"shape": self.shape, "typestr": self.dtype.str,
                                         "data": (0, False), "version": 3}

    def get(self, out=None):
        self.cp.log.append(("to host", self.cp.current))
        out[...] = self.data_
        return out


@pytest.fixture
def cupy(monkeypatch):
    cp = types.ModuleType("cupy")
    cp.current, cp.log, cp.pinned = 0, [], []

    class Device:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            self.prev, cp.current = cp.current, self.index

        def __exit__(self, *exc):
            cp.current = self.prev

    class Stream:
        def synchronize(self):
            cp.log.append(("stream sync", cp.current))

    def asarray(host):
        cp.log.append(("to device", cp.current))
        return FakeCupyArray(cp, host, cp.current)

    def empty_pinned(shape, dtype):
        out = np.empty(shape, dtype)
        cp.pinned.append(out)
        return out

    cp.asarray, cp.ndarray = asarray, FakeCupyArray
    cp.cuda = types.SimpleNamespace(Device=Device, get_current_stream=lambda: Stream())
    cupyx = types.ModuleType("cupyx")
    cupyx.empty_pinned = empty_pinned
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setitem(sys.modules, "cupyx", cupyx)
    return cp


def test_device_route():
    assert staging.device_route(True, "NCCL 2.28.9") == (staging.NCCL, "NCCL 2.28.9")
    assert staging.device_route(False, "ranks 0, 1 on vm would share one GPU (0:1)") == \
        (staging.STAGED, "NCCL is off for this job (ranks 0, 1 on vm would share one GPU (0:1))")


def test_to_pinned_host_copies_on_the_arrays_device(cupy):
    host = staging.to_pinned_host(FakeCupyArray(cupy, [1.0, 2.0], device_id=1))
    assert host is cupy.pinned[0] and host.tolist() == [1.0, 2.0]
    assert cupy.log == [("to host", 1)] and cupy.current == 0


def test_results_return_on_the_callers_device_and_are_complete(cupy):
    back = staging.returning_on(1)
    out = back(np.array([3.0]))
    assert out.device.id == 1 and out.data_.tolist() == [3.0]
    assert cupy.log == [("to device", 1), ("stream sync", 1)]
    rows, splits = staging.returning_on(2)((np.ones((2, 2)), np.array([1, 1])))
    assert rows.device.id == 2 and isinstance(splits, np.ndarray)  # splits stay host metadata
    firsts = staging.returning_on(0, lambda r: r[0])((np.zeros(3), np.array([3])))
    assert firsts.device.id == 0 and firsts.shape == (3,)
    assert [a.device.id for a in staging.returning_on(3)([np.ones(1), np.ones(2)])] == [3, 3]
    assert staging.returning_on(0)(np.array(5.0)).shape == ()  # a scalar stays a scalar


def test_one_warning_per_process(caplog, monkeypatch):
    monkeypatch.setattr(staging, "_warned", staging.threading.Event())
    with caplog.at_level(logging.WARNING, logger="horolite"):
        staging.warn_once("NCCL is off for this job (x)")
        staging.warn_once("NCCL is off for this job (x)")
    lines = [r.getMessage() for r in caplog.records if r.name == "horolite.core.staging"]
    assert lines == ["device arrays are staged through host memory: NCCL is off for this job (x); "
                     "NCCL runs when every rank has its own GPU"]


class RuntimeWithoutNccl:
    nccl, nccl_reason, set_label = None, "ranks 0, 1 on vm would share one GPU (0:1)", None

    def __init__(self):
        self.entries = []

    def submit(self, entry, ring=True):
        self.entries.append(entry)
        return entry.handle


def test_submit_stages_a_device_array_when_nccl_is_off(cupy, monkeypatch):
    monkeypatch.setattr(staging, "_warned", staging.threading.Event())
    rt = RuntimeWithoutNccl()
    handle = collectives._submit(Kind.ALLREDUCE, FakeCupyArray(cupy, [1.0, 2.0], 1), "g", rt=rt,
                                 op=1)
    entry = rt.entries[0]
    assert entry.array is cupy.pinned[0] and entry.request.device == "cpu" and entry.ready is None
    handle._set_result(entry.array * 2)  # what the host path would hand back
    got = handle.result()
    assert isinstance(got, FakeCupyArray) and got.device.id == 1 and got.data_.tolist() == [2.0, 4.0]
    assert cupy.log == [("to host", 1), ("to device", 1), ("stream sync", 1)]
