"""The GPU path's pure parts: device detection, device selection, NCCL id bytes,
nccl_status, and the device mismatch message (one process, no MPI, no GPU needed)."""
import os
import subprocess
import sys

import numpy as np
import pytest

from horolite.core import device
from horolite.core.messages import Kind, Request
from horolite.coordination.negotiation import check_requests
from horolite.transport import nccl as nccl_mod

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


# ---- what is a device array (duck typing only: these objects hold no memory) ----
class CudaArrayInterface:
    __cuda_array_interface__ = {"shape": (2,), "typestr": "<f4", "data": (0, False), "version": 3}


class DLPackOn:
    def __init__(self, kind, index=0, fail=False):
        self.kind, self.index, self.fail = kind, index, fail

    def __dlpack_device__(self):
        if self.fail:
            raise RuntimeError("cannot say")
        return (self.kind, self.index)

    def __dlpack__(self, stream=None):
        raise AssertionError("detection must not export")


def test_numpy_and_scalars_are_host():
    for obj in (np.ones(3), np.float32(1), 3.0, [1, 2], None):
        assert not device.is_device_array(obj)
        assert device.device_kind(obj) == "cpu"
        assert device.device_string(obj) == "cpu"


def test_cuda_array_interface_is_device():
    assert device.is_device_array(CudaArrayInterface())
    assert device.device_kind(CudaArrayInterface()) == "cuda"


@pytest.mark.parametrize("kind,expected", [(1, False), (2, True), (3, False), (13, True), (10, False)])
def test_dlpack_device_types(kind, expected):
    # 1 CPU, 2 CUDA, 3 CUDA pinned host memory, 13 CUDA managed, 10 ROCm
    assert device.is_device_array(DLPackOn(kind)) is expected


class RaisingInterface:
    """Like a framework's CPU tensor: the property exists on the type but refuses."""
    @property
    def __cuda_array_interface__(self):
        raise ValueError("not a CUDA tensor")

    def __dlpack_device__(self):
        return (1, 0)


def test_refusing_cuda_interface_is_host():
    assert not device.is_device_array(RaisingInterface())


def test_dlpack_device_string_and_broken_exporter():
    assert device.device_string(DLPackOn(2, 3)) == "cuda:3"
    assert not device.is_device_array(DLPackOn(2, fail=True))


def test_device_kind_not_index_is_what_negotiation_compares():
    # Ranks on one host use cuda:0, cuda:1...: that must not be a mismatch.
    assert device.device_kind(DLPackOn(2, 0)) == device.device_kind(DLPackOn(2, 1)) == "cuda"


def test_host_device_mix_is_a_mismatch_naming_ranks():
    def req(dev):
        return Request(name="g", kind=Kind.ALLREDUCE, dtype="float32", shape=(4,), device=dev)
    resp = check_requests("g", {0: req("cpu"), 1: req("cuda"), 2: req("cpu")}, 3)
    assert resp.error == "tensor 'g': mismatched device: ranks 0, 2 had cpu, rank 1 had cuda"
    assert resp.error_type == "mismatch"
    ok = check_requests("g", {0: req("cuda"), 1: req("cuda")}, 2)
    assert ok.error is None and ok.device == "cuda"


def test_tf_to_cupy_refuses_host_tensors():
    class HostTensor(DLPackOn):
        device = "/job:localhost/replica:0/task:0/device:CPU:0"
    from horolite.core.tf_dlpack import tf_to_cupy
    # The message says where the memory is (DLPack), not the op's device.
    with pytest.raises(ValueError, match=r"needs a tensor in GPU memory; this one's memory is on "
                                         r"DLPack device \(1, 0\)"):
        tf_to_cupy(HostTensor(1))


# ---- device selection ----
@pytest.mark.parametrize("local_rank,count,expected", [
    (0, 1, 0), (3, 1, 0), (0, 4, 0), (1, 4, 1), (3, 4, 3), (5, 4, 1), (2, 8, 2)])
def test_select_device_from_local_rank(local_rank, count, expected):
    assert device.select_device(local_rank, count) == expected


def test_select_device_override():
    assert device.select_device(3, 4, (1,)) == 1
    assert device.select_device(0, 4, (2, 3)) == 2
    assert device.select_device(1, 4, (2, 3)) == 3
    assert device.select_device(2, 4, (2, 3)) == 2
    with pytest.raises(ValueError, match="asks for device 5 but this process sees 4"):
        device.select_device(0, 4, (5,))
    with pytest.raises(ValueError, match="no CUDA device"):
        device.select_device(0, 0)


def test_parse_device_override():
    assert device.parse_device_override(None) is None
    assert device.parse_device_override("  ") is None
    assert device.parse_device_override("1") == (1,)
    assert device.parse_device_override("2, 3") == (2, 3)
    for bad in ("x", "1,,2", "-1"):
        with pytest.raises(ValueError, match="HOROLITE_GPU_DEVICE"):
            device.parse_device_override(bad)


def test_device_for_rank_reads_both_spellings(monkeypatch):
    monkeypatch.delenv("HOROLITE_GPU_DEVICE", raising=False)
    monkeypatch.delenv("HOROVOD_GPU_DEVICE", raising=False)
    assert device.device_for_rank(3, 2) == 1
    monkeypatch.setenv("HOROVOD_GPU_DEVICE", "0")
    assert device.device_for_rank(3, 2) == 0
    monkeypatch.setenv("HOROLITE_GPU_DEVICE", "1")  # HOROLITE_ wins
    assert device.device_for_rank(0, 2) == 1


# ---- NCCL unique id as bytes ----
def test_unique_id_forms():
    raw = bytes(range(128))
    assert nccl_mod.unique_id_to_bytes(raw) == raw
    assert nccl_mod.unique_id_to_bytes(bytearray(raw)) == raw
    # Older CuPy: a tuple of 128 signed chars.
    signed = tuple(b - 256 if b > 127 else b for b in bytes(range(64, 192)))
    assert nccl_mod.unique_id_to_bytes(signed) == bytes(range(64, 192))
    with pytest.raises(ValueError, match="128 bytes, got 5"):
        nccl_mod.unique_id_to_bytes(b"short")


# ---- whether the job uses NCCL (every rank decides the same from the same answers) ----
def test_decide_nccl_every_rank_needs_a_gpu():
    none = (False, "no CUDA device: no driver (libcuda.so.1 not found)", "h", "")
    assert nccl_mod.decide_nccl([none, none]) == (False, none[1])
    other = (False, "no CUDA device: cupy not installed", "h", "")
    go, why = nccl_mod.decide_nccl([none, other])
    assert not go and why == f"rank 0: {none[1]}; rank 1: {other[1]}"
    gpu = (True, "NCCL 2.21.5 with 2 CUDA device(s), CuPy 13.3.0", "h", "0000:01:00.0")
    go, why = nccl_mod.decide_nccl([gpu, none, none])
    assert not go and why.startswith("not every rank can use NCCL (rank 1: no CUDA device")


def test_decide_nccl_one_gpu_per_rank():
    def gpu(host, bus):
        return (True, "NCCL 2.21.5 with 2 CUDA device(s)", host, bus)
    assert nccl_mod.decide_nccl([gpu("a", "0:1"), gpu("a", "0:2"), gpu("b", "0:1")]) == \
        (True, "NCCL 2.21.5 with 2 CUDA device(s)")
    go, why = nccl_mod.decide_nccl([gpu("a", "0:1"), gpu("a", "0:2"), gpu("a", "0:1")])
    assert not go
    assert why.startswith("ranks 0, 2 on a would share one GPU (0:1); NCCL needs one GPU per rank")


def test_shared_gpu_test_switch_lets_ranks_share_one_gpu():
    """Test-only: ranks on one GPU use NCCL anyway, each with its own NCCL host id."""
    def gpu(host, bus):
        return (True, "NCCL 2.28.9 with 1 CUDA device(s)", host, bus)
    one_gpu = [gpu("vm", "0:1")] * 4
    go, why = nccl_mod.decide_nccl(one_gpu, allow_shared=True)
    assert go and why == "NCCL 2.28.9 with 1 CUDA device(s) (test switch: ranks share a GPU, " \
        "one NCCL host id each)"
    assert nccl_mod.decide_nccl(one_gpu)[0] is False  # the default: refused
    # The switch never makes NCCL out of a rank without a GPU.
    none = (False, "no CUDA device: 0 devices", "vm", "")
    assert nccl_mod.decide_nccl([gpu("vm", "0:1"), none], allow_shared=True)[0] is False
    ids = {nccl_mod.shared_gpu_host_id("vm", r) for r in range(4)}
    assert len(ids) == 4 and nccl_mod.shared_gpu_host_id("vm", 2) == "horolite-test-vm-rank2"


@pytest.mark.parametrize("value,on", [(None, False), ("", False), ("0", False), ("1", True),
                                      ("yes", False)])
def test_shared_gpu_test_switch_is_exactly_1(value, on):
    env = {} if value is None else {nccl_mod.SHARED_GPU_TEST_SWITCH: value}
    assert nccl_mod.shared_gpu_test_switch(env) is on
    assert nccl_mod.SHARED_GPU_TEST_SWITCH == "HOROLITE_TEST_NCCL_SHARED_GPU"


# ---- nccl_status and imports ----
def _python(code):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_import_horolite_imports_no_cupy():
    out = _python("import sys, horolite, horolite.core.device, horolite.transport.nccl\n"
                  "print('cupy' in sys.modules, 'tensorflow' in sys.modules, 'mpi4py.MPI' in sys.modules)")
    assert out.split() == ["False", "False", "False"]


def test_nccl_status_shape_and_reason():
    ok, reason = device.nccl_status()
    assert isinstance(ok, bool) and reason
    if ok:
        assert reason.startswith("NCCL ")
        assert device.cuda_device_count() >= 1
    else:
        assert device.cuda_device_count() == 0 or "NCCL does not load" in reason
    assert device.nccl_status() == (ok, reason)  # computed once


def test_no_driver_means_no_cupy_import():
    """Without a CUDA driver, asking about NCCL does not even import CuPy."""
    out = _python("import sys\nfrom horolite import device\nok, why = device.nccl_status()\n"
                  "print(ok, 'cupy' in sys.modules)\nprint(why)")
    first, reason = out.splitlines()[0], out.splitlines()[1]
    if first.startswith("True"):
        pytest.skip(f"this machine has a usable GPU: {reason}")
    if "cupy not installed" in reason or "no driver" in reason:
        assert first == "False False", out
    assert reason.startswith("no CUDA device: ") or "NCCL does not load" in reason


def test_cupy_imported_without_driver_leaves_host_helpers_alone():
    """CuPy installed but no driver: importing it first changes nothing for host arrays."""
    pytest.importorskip("cupy")
    out = _python("import cupy, numpy as np\nfrom horolite.core import device\n"
                  "print(device.is_device_array(np.ones(2)), device.device_kind(np.ones(2)))\n"
                  "print(device.nccl_status())")
    assert out.splitlines()[0] == "False cpu"
