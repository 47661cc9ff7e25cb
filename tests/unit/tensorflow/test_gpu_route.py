"""The TensorFlow GPU route's decisions, without a GPU (one process, no MPI).

Fake tensors say where their memory is (DLPack device, backing_device) the way
TensorFlow's do inside a py_function; a fake `cupy` module (horolite imports
CuPy lazily) records which device was current when it was asked to copy or
synchronize. What these cannot show (real DLPack, real streams) waits for a GPU
(tests/parallel/test_gpu.py).
"""
import sys
import types

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from horolite.core import tf_dlpack  # noqa: E402
from horolite.tensorflow import bridge, gpu_route  # noqa: E402
from horolite.tensorflow.sync_batch_norm import SyncBatchNormalization  # noqa: E402

CPU0 = "/job:localhost/replica:0/task:0/device:CPU:0"
GPU = "/job:localhost/replica:0/task:0/device:GPU:{}"


class FakeTensor:
    """What a py_function input looks like: `device` says CPU, the memory is elsewhere."""

    def __init__(self, dlpack=(2, 0), device=CPU0, backing=None, dtype=tf.float32):
        self._dlpack, self.device, self.dtype = dlpack, device, dtype
        if backing is not None:
            self.backing_device = backing

    def __dlpack_device__(self):
        if self._dlpack is None:
            raise AttributeError("no DLPack")
        return self._dlpack

    def numpy(self):
        return np.ones(3, np.float32)


# ---- the route of one tensor ----
def test_py_function_input_on_the_gpu_takes_the_device_route():
    t = FakeTensor(dlpack=(2, 0), device=CPU0, backing=GPU.format(0))
    assert gpu_route.tensor_route(t, True) == (gpu_route.CUDA, "its memory is on GPU:0")


def test_backing_device_is_read_when_dlpack_cannot_say():
    t = FakeTensor(dlpack=None, device=CPU0, backing=GPU.format(1))
    assert gpu_route.memory_device(t) == ("GPU", 1)
    assert gpu_route.tensor_route(t, True)[0] == gpu_route.CUDA


def test_gpu_op_with_host_memory_output_takes_the_host_route():
    t = FakeTensor(dlpack=(1, 0), device=GPU.format(0), dtype=tf.int32)
    assert gpu_route.tensor_route(t, True) == (gpu_route.HOST, "its memory is on CPU")


def test_bfloat16_and_int32_stay_on_the_host():
    assert gpu_route.tensor_route(FakeTensor(dtype=tf.bfloat16), True) == \
        (gpu_route.HOST, "bfloat16 cannot cross DLPack into CuPy")
    assert gpu_route.tensor_route(FakeTensor(dtype=tf.int32), True)[0] == gpu_route.HOST


def test_nccl_off_means_host():
    assert gpu_route.tensor_route(FakeTensor(), False) == (gpu_route.HOST, "NCCL is off for this job")


def test_a_real_cpu_tensor_is_host_memory():
    assert gpu_route.memory_device(tf.constant([1.0])) == ("CPU", 0)


def test_bridge_routes_on_memory_not_on_t_device(monkeypatch):
    taken = []
    monkeypatch.setattr(gpu_route, "to_device_array", lambda t: taken.append(t) or "device copy")
    gpu_input = FakeTensor(dlpack=(2, 0), device=CPU0)
    assert bridge._to_runtime(gpu_input) == "device copy" and taken == [gpu_input]
    host = bridge._to_runtime(tf.constant([1.0, 2.0]))
    assert isinstance(host, np.ndarray) and host.tolist() == [1.0, 2.0] and len(taken) == 1


# ---- which ops a graph gets ----
def test_device_ops_pure():
    assert gpu_route.device_ops(True, 1, ["float32"])
    assert gpu_route.device_ops(True, 1, ["float32", "int64"])  # alltoall: rows and splits
    assert not gpu_route.device_ops(True, 0, ["float32"])  # TensorFlow sees no GPU
    assert not gpu_route.device_ops(True, 1, ["int32"])  # EagerPyFunc has no int32 GPU kernel
    assert not gpu_route.device_ops(False, 1, ["float32"])


def test_cpu_tensorflow_keeps_the_host_ops_when_only_cupy_sees_a_gpu(monkeypatch):
    """NCCL up, TensorFlow a CPU build: graphs keep numpy_function and the native wait op."""
    monkeypatch.setattr(bridge, "_nccl_active", lambda: True)
    seen = []

    @tf.function
    def trace():
        seen.append(bridge._device_ops([tf.float32]))
        return tf.constant(0)
    trace()
    assert seen == [False] and bridge._tf_gpu_count() == len(tf.config.list_logical_devices("GPU"))
    monkeypatch.setattr(bridge, "_tf_gpus", [1])  # as if TensorFlow had a GPU
    tf.function(lambda: seen.append(bridge._device_ops([tf.float32])) or tf.constant(0))()
    tf.function(lambda: seen.append(bridge._device_ops([tf.int32])) or tf.constant(0))()
    assert seen == [False, True, False]


# ---- TensorFlow's logical GPU index vs the CUDA ordinal ----
def test_cuda_ordinals_from_visible_devices():
    # set_visible_devices(gpus[2]): TF GPU:0 is CUDA device 2
    assert tf_dlpack.cuda_ordinals(["/physical_device:GPU:2"]) == (2,)
    assert tf_dlpack.cuda_ordinals(["/physical_device:GPU:0", "/physical_device:GPU:3"]) == (0, 3)
    # a GPU split into two logical devices
    assert tf_dlpack.cuda_ordinals(["/physical_device:GPU:1", "/physical_device:GPU:2"],
                                   [2, 1]) == (1, 1, 2)
    with pytest.raises(ValueError, match="not a TensorFlow GPU device name"):
        tf_dlpack.cuda_ordinals(["/physical_device:CPU:0"])


def test_ordinal_and_index_both_ways():
    ordinals = (3, 1)
    assert tf_dlpack.ordinal_of(0, ordinals) == 3 and tf_dlpack.ordinal_of(1, ordinals) == 1
    assert tf_dlpack.tf_index_of(3, ordinals) == 0 and tf_dlpack.tf_index_of(1, ordinals) == 1
    with pytest.raises(ValueError, match=r"TensorFlow GPU:2 is not one of its visible GPUs"):
        tf_dlpack.ordinal_of(2, ordinals)
    with pytest.raises(ValueError, match=r"CUDA device 0 is not visible to TensorFlow"):
        tf_dlpack.tf_index_of(0, ordinals)


def test_this_processes_ordinals_read_tf_config():
    assert tf_dlpack.tf_gpu_ordinals() == tuple(
        int(d.name.rsplit(":", 1)[1]) for d in tf.config.get_visible_devices("GPU"))


# ---- a fake CuPy: which device is current when it copies, synchronizes, exports ----
class FakeCupy(types.ModuleType):
    def __init__(self):
        super().__init__("cupy")
        self.current, self.log = 0, []
        fake = self

        class Device:
            def __init__(self, index):
                self.index = self.id = index

            def __enter__(self):
                self.prev, fake.current = fake.current, self.index

            def __exit__(self, *exc):
                fake.current = self.prev

        class Stream:
            def synchronize(self):
                fake.log.append(("stream sync", fake.current))

        runtime = types.SimpleNamespace(
            deviceSynchronize=lambda: fake.log.append(("device sync", fake.current)),
            pointerGetAttributes=lambda ptr: types.SimpleNamespace(device=fake.memory_on))
        self.cuda = types.SimpleNamespace(
            Device=Device, runtime=runtime, get_current_stream=lambda: Stream(),
            UnownedMemory=lambda ptr, size, owner, device_id: types.SimpleNamespace(
                ptr=ptr, size=size, owner=owner, device_id=device_id),
            MemoryPointer=lambda mem, offset: types.SimpleNamespace(mem=mem, offset=offset))

    memory_on = 0  # the device the driver says a pointer is on

    def from_dlpack(self, capsule):
        if not isinstance(capsule, tuple):  # a producer refusing the stream handshake
            raise RuntimeError("TensorFlow does not support DLPack export with a non-None stream")
        _, device_id = capsule
        return FakeArray(self, device_id)

    @property
    def ndarray(self):
        """A type (as_cupy asks isinstance) whose construction is CuPy's view over memory."""
        fake = self

        def new(cls, shape, dtype, memptr, strides=None):
            mem = memptr.mem
            return FakeArray(fake, mem.device_id, shape, dtype, mem.ptr, mem.owner)
        return type("ndarray", (), {"__new__": new})

    def empty(self, shape, dtype):
        return FakeArray(self, self.current, shape, dtype)


class FakeArray:
    def __init__(self, cp, device_id, shape=(4,), dtype=np.float32, ptr=0x7000, owner=None):
        self.cp, self.device = cp, cp.cuda.Device(device_id)
        self.shape, self.dtype, self.owner = shape, np.dtype(dtype), owner
        self.size = int(np.prod(shape))
        self.nbytes, self.strides = self.size * self.dtype.itemsize, (self.dtype.itemsize,)
        self.data = types.SimpleNamespace(ptr=ptr)

    def copy(self):
        self.cp.log.append(("copy", self.cp.current))
        return FakeArray(self.cp, self.cp.current, self.shape, self.dtype)

    def toDlpack(self):
        return ("capsule of", self.device.id)


@pytest.fixture
def cupy(monkeypatch):
    fake = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(tf.experimental.dlpack, "to_dlpack",
                        lambda t: ("tf capsule", t.__dlpack_device__()[1]))
    monkeypatch.setattr(tf.experimental.dlpack, "from_dlpack", lambda capsule: capsule)
    return fake


def test_tf_to_cupy_relabels_tf_index_to_cuda_ordinal(cupy):
    """set_visible_devices(gpus[1]): TF exports device_id 0 for memory on CUDA device 1."""
    array = tf_dlpack.tf_to_cupy(FakeTensor(dlpack=(2, 0)), ordinals=(1,))
    assert array.device.id == 1 and array.data.ptr == 0x7000 and array.owner.device.id == 0
    assert cupy.log == [("device sync", 1)]
    same = tf_dlpack.tf_to_cupy(FakeTensor(dlpack=(2, 1)), ordinals=(0, 1))
    assert same.device.id == 1 and same.owner is None  # nothing to relabel


def test_cupy_to_tf_exports_tensorflows_index(cupy):
    result = FakeArray(cupy, 1)
    assert tf_dlpack.cupy_to_tf(result, ordinals=(1,)) == ("capsule of", 0)
    assert tf_dlpack.cupy_to_tf(result, ordinals=(0, 1)) == ("capsule of", 1)


def test_eager_tensor_given_to_the_numpy_api_lands_on_its_real_device(cupy):
    """hvd.allreduce(tf_gpu_tensor): TF refuses the handshake and writes its own index into the
    capsule; the driver's answer for the pointer is the device used."""
    from horolite.core import device

    class Exporter(FakeTensor):
        def __dlpack__(self):
            return ("tf capsule", 0)
    cupy.memory_on = 1
    array = device.as_cupy(Exporter(dlpack=(2, 0)))
    assert array.device.id == 1 and cupy.log == [("device sync", 1)]
    cupy.memory_on, cupy.log[:] = 0, []
    assert device.as_cupy(Exporter(dlpack=(2, 0))).device.id == 0


def test_results_stay_alive_until_the_next_device_sync(cupy, monkeypatch):
    """TensorFlow may still be reading a result when it drops it: CuPy must not reuse it."""
    monkeypatch.setattr(tf_dlpack, "_handed", [])
    first, second = FakeArray(cupy, 0), FakeArray(cupy, 0)
    tf_dlpack.cupy_to_tf(first, ordinals=(0,))
    tf_dlpack.cupy_to_tf(second, ordinals=(0,))
    assert tf_dlpack._handed == [first, second]
    tf_dlpack.tf_to_cupy(FakeTensor(dlpack=(2, 0)), ordinals=(0,))  # synchronizes the device
    assert tf_dlpack._handed == []
    tf_dlpack.tf_to_cupy(FakeTensor(dlpack=(2, 0)), ordinals=(0,), synchronize=False)
    tf_dlpack.cupy_to_tf(first, ordinals=(0,))
    tf_dlpack.tf_to_cupy(FakeTensor(dlpack=(2, 0)), ordinals=(0,), synchronize=False)
    assert tf_dlpack._handed == [first]  # no sync, nothing released
    monkeypatch.setattr(tf_dlpack, "_HANDED_LIMIT", 2)
    tf_dlpack.cupy_to_tf(second, ordinals=(0,))
    tf_dlpack.cupy_to_tf(second, ordinals=(0,))
    assert len(tf_dlpack._handed) == 1 and cupy.log[-1] == ("device sync", 0)


def test_input_copy_is_made_on_the_tensors_gpu_and_finished(cupy, monkeypatch):
    monkeypatch.setattr(tf_dlpack, "_ordinals", (0, 1))
    out = gpu_route.to_device_array(FakeTensor(dlpack=(2, 1)))
    assert out.device.id == 1  # not CuPy's current device (0)
    assert cupy.log == [("device sync", 1), ("copy", 1), ("stream sync", 1)]
    assert cupy.current == 0


# ---- XLA ----
def test_collectives_refuse_xla_with_a_clear_message():
    @tf.function(jit_compile=True)
    def step(x):
        return bridge.enqueue_allreduce(x, "xla.grad")
    with pytest.raises(ValueError, match="cannot run inside an XLA-compiled function"):
        step(tf.constant([1.0]))


def test_sync_batch_norm_keeps_keras_off_xla():
    import keras
    layer = SyncBatchNormalization()
    assert layer.supports_jit is False
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), layer])
    with pytest.warns(UserWarning, match="doesn't support `jit_compile=True`"):
        model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    assert model.jit_compile is False
