"""Public path of the GPU helpers users call (``horolite.device.nccl_status()`` and the
TensorFlow/CuPy conversions); the implementation lives in horolite.core.device."""
from .core.device import cuda_device_count, device_kind, is_device_array, nccl_status
from .core.tf_dlpack import cupy_to_tf, tf_to_cupy

__all__ = ["cuda_device_count", "cupy_to_tf", "device_kind", "is_device_array", "nccl_status",
           "tf_to_cupy"]
