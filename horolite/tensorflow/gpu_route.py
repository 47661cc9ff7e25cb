"""Which way a TensorFlow tensor reaches the runtime on a GPU job: over NCCL or through the host.

The decision reads where a tensor's *memory* is (its DLPack device, else
`backing_device`), never `t.device`: inside a `tf.py_function` (every
`tf.function` and Keras `fit` step) an input's `device` says CPU while its
memory is on the GPU, so deciding on it would send every gradient through the
host. Everything after the DLPack handoff is the CuPy path of the runtime.

Two decisions, both pure:

* `route(...)`, per tensor when the op runs: "cuda" (a CuPy copy on the
  tensor's own GPU, then NCCL) or "host" (a NumPy copy), with the reason.
* `device_ops(...)`, per op when a graph is built: whether the enqueue/wait
  pair are `tf.py_function`s (which can hand over GPU memory) or the host ops
  (`tf.numpy_function` and the native wait op, with Horovod's error classes and
  no TensorFlow thread held while waiting). Python ops run on a GPU only for
  dtypes TensorFlow's GPU kernel of EagerPyFunc takes, so an op of int32 tensors
  only (a loss-scale agreement) or a TensorFlow that sees no GPU (a CPU build on
  a machine where CuPy finds one) keeps the host ops.
"""
from __future__ import annotations

import re
from typing import Optional, Sequence, Tuple

from horolite.core.device import _DLPACK_CUDA, _dlpack_device

__all__ = ["CUDA", "HOST", "HOST_ONLY_DTYPES", "memory_device", "route", "device_ops",
           "tensor_route", "to_device_array"]

CUDA, HOST = "cuda", "host"

# Dtypes that cannot take the device route: EagerPyFunc's GPU kernel excludes int32,
# string and resource (such an op runs on the CPU), and CuPy has no bfloat16 to take
# across DLPack ("CuPy does not support bfloat16 yet").
HOST_ONLY_DTYPES = frozenset({"int32", "string", "resource", "variant", "bfloat16"})

_DEVICE_NAME = re.compile(r"(?:device:)?([A-Z_]+):(\d+)$")


def memory_device(t) -> Optional[Tuple[str, int]]:
    """("GPU", k) or ("CPU", 0): where a tensor's memory is, from DLPack or backing_device."""
    where = _dlpack_device(t)
    if where is not None:
        return ("GPU", where[1]) if where[0] in _DLPACK_CUDA else ("CPU", 0)
    match = _DEVICE_NAME.search(getattr(t, "backing_device", "") or "")
    return (match.group(1), int(match.group(2))) if match else None


def route(memory: Optional[Tuple[str, int]], dtype_name: str, nccl_up: bool) -> Tuple[str, str]:
    """(CUDA or HOST, why) for one tensor whose memory is at `memory`. Pure."""
    if not nccl_up:
        return HOST, "NCCL is off for this job"
    if memory is None or memory[0] != "GPU":
        return HOST, f"its memory is on {memory[0] if memory else 'an unknown device'}"
    if dtype_name in HOST_ONLY_DTYPES:
        return HOST, f"{dtype_name} cannot cross DLPack into CuPy"
    return CUDA, f"its memory is on GPU:{memory[1]}"


def tensor_route(t, nccl_up: bool) -> Tuple[str, str]:
    """route() of an eager tensor."""
    return route(memory_device(t), t.dtype.name, nccl_up)


def device_ops(nccl_up: bool, tf_gpus: int, dtype_names: Sequence[str]) -> bool:
    """Whether an op's enqueue/wait must be Python ops that can carry GPU memory. Pure."""
    return nccl_up and tf_gpus > 0 and any(d not in HOST_ONLY_DTYPES for d in dtype_names)


def to_device_array(t):
    """A CuPy copy of a GPU tensor, made on the tensor's own CUDA device.

    The copy is needed because TensorFlow may reuse the tensor's memory once the
    op returns, and it is finished before this returns: TensorFlow's streams are
    not ordered against CuPy's, so nothing else would keep TensorFlow from
    writing that memory while the copy still reads it.
    """
    import cupy

    from horolite.core.tf_dlpack import tf_to_cupy
    view = tf_to_cupy(t)
    with cupy.cuda.Device(view.device.id):
        out = view.copy()
        cupy.cuda.get_current_stream().synchronize()
    return out
