"""TensorFlow GPU tensors <-> CuPy arrays through DLPack, with TensorFlow's device numbering.

TensorFlow writes its *logical* GPU index into a DLPack capsule (`GPU:k` ->
device_id k) and reads it back the same way, while CuPy and NCCL use CUDA
ordinals. The two differ as soon as TensorFlow's visible devices are narrowed
(`tf.config.set_visible_devices(gpus[local_rank], 'GPU')`, Horovod's pinning
idiom: TF `GPU:0` is then CUDA device `local_rank`). So ids are translated in
both directions from the visible physical devices, whose names carry the
CUDA ordinal (`/physical_device:GPU:n`, n counted under CUDA_VISIBLE_DEVICES).

CuPy and TensorFlow are imported only when a conversion runs.
"""
from __future__ import annotations

import re
import threading
from typing import Optional, Sequence, Tuple

from .device import _DLPACK_CUDA, _cupy, _dlpack_device, relabelled

__all__ = ["cuda_ordinals", "ordinal_of", "tf_index_of", "tf_gpu_ordinals", "tf_to_cupy",
           "cupy_to_tf"]

_GPU_NAME = re.compile(r"GPU:(\d+)$")


def cuda_ordinals(visible: Sequence[str], splits: Optional[Sequence[int]] = None) -> Tuple[int, ...]:
    """TensorFlow's logical GPU k -> the CUDA ordinal behind it, as a tuple indexed by k.

    `visible`: the names of TF's visible physical GPUs in order
    (`tf.config.get_visible_devices('GPU')`); `splits`: how many logical devices
    each is split into (virtual device configurations; 1 when not split). Pure.
    """
    ordinals = []
    for i, name in enumerate(visible):
        match = _GPU_NAME.search(name)
        if match is None:
            raise ValueError(f"not a TensorFlow GPU device name: {name!r}")
        ordinals += [int(match.group(1))] * (splits[i] if splits else 1)
    return tuple(ordinals)


def ordinal_of(tf_index: int, ordinals: Sequence[int]) -> int:
    """The CUDA ordinal of TensorFlow's logical GPU `tf_index`."""
    if not 0 <= tf_index < len(ordinals):
        raise ValueError(f"TensorFlow GPU:{tf_index} is not one of its visible GPUs "
                         f"({len(ordinals)} logical)")
    return ordinals[tf_index]


def tf_index_of(ordinal: int, ordinals: Sequence[int]) -> int:
    """TensorFlow's logical index of CUDA device `ordinal` (its first, if split)."""
    try:
        return list(ordinals).index(ordinal)
    except ValueError:
        raise ValueError(f"CUDA device {ordinal} is not visible to TensorFlow (it sees CUDA "
                         f"devices {sorted(set(ordinals))}; tf.config.set_visible_devices)") from None


# Results handed to TensorFlow, kept alive until a later device synchronization.
_handed: list = []
_HANDED_LIMIT = 4096
_handed_lock = threading.Lock()

_ordinals_lock = threading.Lock()
_ordinals: Optional[Tuple[int, ...]] = None


def tf_gpu_ordinals() -> Tuple[int, ...]:
    """`cuda_ordinals` of this process's TensorFlow (fixed once TensorFlow's runtime is up)."""
    global _ordinals
    with _ordinals_lock:
        if _ordinals is None:
            import tensorflow as tf
            visible = tf.config.get_visible_devices("GPU")
            splits = [len(tf.config.get_logical_device_configuration(d) or [None]) for d in visible]
            _ordinals = cuda_ordinals([d.name for d in visible], splits)
        return _ordinals


def tf_to_cupy(tensor, synchronize: bool = True, ordinals: Optional[Sequence[int]] = None):
    """A CuPy array sharing a TensorFlow GPU tensor's memory (through DLPack, no copy),
    on the CUDA device the memory is really on.

    TensorFlow runs GPU work on its own streams, which CuPy's streams know
    nothing about; with `synchronize` (the default) that device is synchronized
    first so the data is complete before horolite reads it. Pass False only
    when the caller has made sure of that itself.
    """
    where = _dlpack_device(tensor)
    if where is None or where[0] not in _DLPACK_CUDA:
        raise ValueError(f"tf_to_cupy needs a tensor in GPU memory; this one's memory is on "
                         f"DLPack device {where} (use tensor.numpy() for host tensors)")
    import tensorflow as tf
    cupy = _cupy()
    ordinal = ordinal_of(where[1], tf_gpu_ordinals() if ordinals is None else ordinals)
    handed_before = len(_handed)
    array = cupy.from_dlpack(tf.experimental.dlpack.to_dlpack(tensor))
    if array.device.id != ordinal:
        if array.size == 0:
            with cupy.cuda.Device(ordinal):
                return cupy.empty(array.shape, array.dtype)
        array = relabelled(cupy, array, ordinal)
    if synchronize:
        with cupy.cuda.Device(ordinal):
            cupy.cuda.runtime.deviceSynchronize()
        # Every TensorFlow kernel enqueued before this sync has run: results handed to
        # TensorFlow before it can go back to CuPy's pool (see cupy_to_tf).
        with _handed_lock:
            del _handed[:handed_before]
    return array


def cupy_to_tf(array, ordinals: Optional[Sequence[int]] = None):
    """A TensorFlow tensor sharing a CuPy array's memory (through DLPack, no copy).

    horolite completes a device collective only after its stream has finished,
    so a result handed back this way is ready for TensorFlow to read. The
    capsule carries TensorFlow's index of the array's GPU, which TensorFlow reads.
    """
    import tensorflow as tf
    cupy = _cupy()
    # TensorFlow drops its reference once the kernels reading the result are *enqueued*,
    # and CuPy would then reuse the memory on its own stream, unordered against
    # TensorFlow's: keep the array until the next device synchronization (tf_to_cupy).
    with _handed_lock:
        _handed.append(array)
        if len(_handed) > _HANDED_LIMIT:  # no input conversion for a long while: sync here
            with cupy.cuda.Device(array.device.id):
                cupy.cuda.runtime.deviceSynchronize()
            del _handed[:-1]
    tf_index = tf_index_of(array.device.id, tf_gpu_ordinals() if ordinals is None else ordinals)
    if tf_index != array.device.id:
        if array.size == 0:
            with tf.device(f"/GPU:{tf_index}"):
                return tf.zeros(array.shape, tf.as_dtype(array.dtype))
        array = relabelled(cupy, array, tf_index)
    capsule = array.toDlpack() if hasattr(array, "toDlpack") else array.__dlpack__()
    return tf.experimental.dlpack.from_dlpack(capsule)
