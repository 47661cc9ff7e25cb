"""The NumPy collectives, with Horovod's names and semantics.

Each call checks its arguments here, on the caller's thread, builds a request
and hands it to the queue; the `_async` forms return the handle at once.
Results are new arrays: inputs are never written.
"""
from __future__ import annotations

import itertools
import math
import threading
from typing import List, Optional, Sequence

import numpy as np

from ..coordination.quorum import check_quorum
from ..coordination.tensor_queue import Entry
from ..core import device as _device
from ..core import staging
from ..core.handle import Handle
from ..core.messages import JOIN_NAME, Kind, Request
from ..core.ops import MOVABLE_DTYPES, REDUCIBLE_DTYPES, Average, ReduceOp, dtype_name
from ..errors import InvalidCollectiveError
from ..runtime import registry
from .adasum import check_adasum
from .basics import runtime
from .grouping import one_handle, pack_host_group, split_group
from .process_sets import SetHandle, global_process_set, runtime_for

__all__ = ["allreduce", "allreduce_async", "grouped_allreduce", "grouped_allreduce_async",
           "allgather", "allgather_async", "broadcast", "broadcast_async",
           "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
           "barrier", "join", "join_async", "poll", "synchronize", "abandon_async"]

_name_lock = threading.Lock()
_counters = {}


def _auto_name(kind: str, rt=None) -> str:
    """Deterministic names: ranks calling collectives in the same order agree (counted
    per process set: a rank outside a set does not count its collectives)."""
    with _name_lock:
        counter = _counters.setdefault((kind, getattr(rt, "set_label", None)), itertools.count())
        return f"{kind}.noname.{next(counter)}"


def _as_array(array, name: str, kind: Kind, rt=None) -> np.ndarray:
    if _device.is_device_array(array):
        # GPU path: a contiguous CuPy view on this rank's GPU, no host copy (device.py).
        arr = _device.device_input(array, name, rt or runtime())
    else:
        try:
            arr = np.asarray(array)
        except Exception as e:  # ragged lists and the like
            raise InvalidCollectiveError(f"tensor '{name}': {kind.label} takes an array, and "
                                         f"{type(array).__name__} is not one ({e})") from None
    dname = dtype_name(arr.dtype)
    allowed = REDUCIBLE_DTYPES if kind in (Kind.ALLREDUCE, Kind.REDUCESCATTER) else MOVABLE_DTYPES
    if dname not in allowed:
        raise InvalidCollectiveError(
            f"tensor '{name}': dtype {dname} is not supported by {kind.label}; "
            f"supported: {', '.join(allowed)}")
    if not arr.dtype.isnative:
        # The kernels read native byte order: a big-endian array on this host is converted
        # (the values are the same), and the result comes back in native order.
        arr = arr.astype(arr.dtype.newbyteorder("="))
    elif _device.needs_contiguous_copy(arr):
        arr = arr.copy(order="C")  # (np.ascontiguousarray would turn scalars into 1-d)
    return arr


# Native-order dtypes allreduce takes, by dtype object (the fast path's only check).
_ALLREDUCE = Kind.ALLREDUCE
_REDUCIBLE_NAMES = {np.dtype(n): n for n in REDUCIBLE_DTYPES if n != "bfloat16"}
try:
    import ml_dtypes as _ml_dtypes
    _REDUCIBLE_NAMES[np.dtype(_ml_dtypes.bfloat16)] = "bfloat16"
except ImportError:  # bfloat16 arrays then take the general path
    pass


def _check_scales(arr, name: str, prescale: float, postscale: float) -> None:
    """Integers are scaled in double and converted back: inf or nan has no value to give."""
    if arr.dtype.kind in "iu" and not (math.isfinite(prescale) and math.isfinite(postscale)):
        raise InvalidCollectiveError(
            f"tensor '{name}': an integer tensor ({dtype_name(arr.dtype)}) needs finite scale "
            f"factors, got prescale_factor={prescale}, postscale_factor={postscale}")


def _reduce_op(op, name: str) -> ReduceOp:
    if op.__class__ is ReduceOp and op != ReduceOp.ADASUM:  # the common case, without Enum's lookup
        return op
    try:
        op = ReduceOp(op)
    except ValueError:
        raise InvalidCollectiveError(f"tensor '{name}': unknown reduce op {op!r}") from None
    return op


def _submit(kind: Kind, array: Optional[np.ndarray], name: str, transform=None, splits=None,
            rt=None, owned: bool = False, parts=None, host_only: bool = False, **fields) -> Handle:
    """host_only: a device array goes through host memory even where NCCL is up (Adasum)."""
    rt = rt or runtime()
    ready = None
    if array is None:
        request = Request(name, kind, "", (), **fields)
    else:
        if array.__class__ is not np.ndarray and not isinstance(array, np.ndarray):
            # A CuPy array from _as_array: over NCCL, or through host memory when NCCL is off.
            route, why = staging.device_route(getattr(rt, "nccl", None) is not None and not host_only,
                                              getattr(rt, "nccl_reason", ""))
            if route == staging.NCCL:
                fields.setdefault("device", _device.CUDA)
                ready = _device.record_ready(array)
            else:
                if not host_only:  # (Adasum's staging is documented, not a fallback)
                    staging.warn_once(why)
                transform = staging.returning_on(array.device.id, transform)
                array = staging.to_pinned_host(array)
        request = Request(name, kind, dtype_name(array.dtype), array.shape, **fields)
    handle = (SetHandle(name, transform, rt.set_label) if rt.set_label else
              Handle(name, transform))
    entry = Entry(request=request, array=array, handle=handle, splits=splits, ready=ready,
                  owned=owned, parts=parts)
    return rt.submit(entry, _ring())


# Set by a synchronous call whose submit is followed at once by the wait: that submit
# leaves the background thread asleep, since the waiting caller runs the cycle itself
# (runtime/turns.py). Read, and cleared, by the first submit.
_waits_now = threading.local()


def _ring() -> bool:
    if getattr(_waits_now, "on", False):
        _waits_now.on = False
        return False
    return True


def submit_and_wait(submit, *args):
    """synchronize(submit(*args)), its submit leaving the background thread asleep."""
    _waits_now.on = True
    try:
        handle = submit(*args)
    finally:
        _waits_now.on = False
    return synchronize(handle)


def allreduce_async(array, op=Average, name: Optional[str] = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, quorum: Optional[int] = None,
                    process_set=global_process_set) -> Handle:
    if process_set is not global_process_set and process_set is not None:
        return _allreduce_async(array, op, name, prescale_factor, postscale_factor, quorum,
                                runtime_for(process_set, "allreduce"))
    if quorum is None and name and array.__class__ is np.ndarray and op.__class__ is ReduceOp and \
            prescale_factor == 1.0 == postscale_factor and array.flags.c_contiguous and \
            array.flags.aligned:
        # The common case (a step's many named gradients), without the general checks'
        # cost: this runs once per tensor per step on the caller's thread.
        dname = _REDUCIBLE_NAMES.get(array.dtype)
        rt = registry.current()
        if dname is not None and op is not ReduceOp.ADASUM and rt is not None:
            return rt.submit(Entry(Request(name, _ALLREDUCE, dname, array.shape, int(op)),
                                   array, Handle(name)), _ring())
    return _allreduce_async(array, op, name, prescale_factor, postscale_factor, quorum, runtime())


def _allreduce_async(array, op, name, prescale_factor, postscale_factor, quorum, rt,
                     members: int = 0) -> Handle:
    """members > 0: `name` is one of that many separate requests of a group
    (Request.members)."""
    name = name or _auto_name("allreduce", rt)
    op = _reduce_op(op, name)
    pre, post = float(prescale_factor), float(postscale_factor)
    k = check_quorum(quorum, op, name, rt.size)
    arr = _as_array(array, name, Kind.ALLREDUCE, rt)
    if k and not isinstance(arr, np.ndarray):
        raise InvalidCollectiveError(f"tensor '{name}': a quorum allreduce takes host (NumPy) arrays")
    _check_scales(arr, name, pre, post)
    if op == ReduceOp.ADASUM:
        check_adasum(arr, name, rt)
    return _submit(Kind.ALLREDUCE, arr, name, rt=rt, op=int(op), prescale=float(prescale_factor),
                   postscale=float(postscale_factor), quorum=k,
                   host_only=op == ReduceOp.ADASUM, members=members)


def abandon_async(name: str, reason: str, process_set=global_process_set) -> Handle:
    """This rank will never send tensor `name`: every rank's request for it fails with an
    error naming this rank and `reason` (its handle here fails the same way)."""
    rt = runtime_for(process_set, "abandon")
    return _submit(Kind.ALLREDUCE, None, name, rt=rt, abandoned=str(reason) or "abandoned")


def allreduce(array, op=Average, name: Optional[str] = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, quorum: Optional[int] = None,
              process_set=global_process_set) -> np.ndarray:
    """Reduce `array` over all ranks (Average by default); returns a new array.

    quorum=k (beyond Horovod): done once k ranks have submitted; the first k to
    do so are reduced (Average divides by k), the others add zeros and get the
    same result for their own, later, submission. `handle.contributors` names the k.
    process_set (every collective takes one): run over that set's ranks only.
    """
    return submit_and_wait(allreduce_async, array, op, name, prescale_factor, postscale_factor,
                            quorum, process_set)


def grouped_allreduce_async(arrays: Sequence, op=Average, name: Optional[str] = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            quorum: Optional[int] = None, process_set=global_process_set) -> Handle:
    """One handle, and one request, for several allreduces.

    Host arrays of one dtype are packed here into one buffer and travel as a
    single tensor (one negotiation, one cache entry); the results are views
    into the reduced buffer, each starting on a 64-byte boundary (TensorFlow
    takes aligned NumPy results without a copy). Mixed dtypes or device arrays
    go as separate tensors submitted together, so they still fuse.
    With quorum=k (see allreduce) the group is one decision: the arrays must be
    host arrays of one dtype.
    """
    return _grouped_allreduce_async(arrays, op, name, prescale_factor, postscale_factor,
                                    quorum=quorum, process_set=process_set)


def _grouped_allreduce_async(arrays: Sequence, op=Average, name: Optional[str] = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             borrowed: bool = False, quorum: Optional[int] = None,
                             process_set=global_process_set) -> Handle:
    """borrowed: the arrays are another framework's memory; the members that go
    separately are copied here (the TensorFlow bridge then need not copy every gradient
    first), a packed group's are packed, and a large one's read where they lie."""
    rt = runtime_for(process_set, "grouped_allreduce")
    base = name or _auto_name("grouped_allreduce", rt)
    op = _reduce_op(op, base)
    k = check_quorum(quorum, op, base, rt.size)
    arrays = list(arrays)
    if op == ReduceOp.ADASUM:
        # Each tensor has its own coefficients: the members go separately (they still fuse).
        if borrowed:
            arrays = [np.array(a, copy=True) if isinstance(a, np.ndarray) else a for a in arrays]
        return _separately(arrays, op, base, prescale_factor, postscale_factor, rt)
    pre, post = float(prescale_factor), float(postscale_factor)
    if not (math.isfinite(pre) and math.isfinite(post)):
        for i, a in enumerate(arrays):
            _check_scales(np.asarray(a) if not hasattr(a, "dtype") else a, f"{base}.{i}", pre, post)
    pool = rt.executor.outputs  # packed there, the group is reduced in place
    # Through shared memory a large group is not packed: its members are read where they
    # lie (the caller must leave them alone until the handle is done, as for any async
    # collective). That holds for TensorFlow's gradients too: the NumPy views the bridge
    # passes keep their tensors' buffers alive, and TensorFlow never writes into a buffer
    # something else still refers to (it forwards only buffers with one reference).
    read_in_place = not k and pre == 1.0 and rt.transport.reads_parts
    packed = pack_host_group(arrays, base, pool, read_in_place)
    if packed is None:
        arrays = [_as_array(a, f"{base}.{i}", Kind.ALLREDUCE, rt) for i, a in enumerate(arrays)]
        if arrays and all(isinstance(a, np.ndarray) for a in arrays) and \
                len({a.dtype for a in arrays}) == 1:
            packed = pack_host_group(arrays, base, pool, read_in_place)
    if packed is not None:
        flat, shapes, owned, parts = packed
        return _submit(Kind.ALLREDUCE, flat, base, transform=lambda out: split_group(out, shapes),
                       rt=rt, owned=owned, parts=parts, op=int(op), prescale=float(prescale_factor),
                       postscale=float(postscale_factor), group=shapes, quorum=k)
    if k:
        raise InvalidCollectiveError(
            f"tensor '{base}': a quorum grouped allreduce takes host arrays of one dtype, got "
            f"{sorted({dtype_name(a.dtype) for a in arrays if hasattr(a, 'dtype')})} "
            f"({'device arrays' if any(not isinstance(a, np.ndarray) for a in arrays) else 'host arrays'})")
    if borrowed:
        arrays = [np.array(a, copy=True) if isinstance(a, np.ndarray) else a for a in arrays]
    return _separately(arrays, op, base, prescale_factor, postscale_factor, rt)


def _separately(arrays: list, op, base: str, prescale_factor, postscale_factor, rt) -> Handle:
    """A group that cannot be one request: its members go as `<base>.<k>`, each saying it is
    one of len(arrays) (so an abandon notice for `base` covers them: coordination/abandon.py),
    behind one handle."""
    return one_handle(base, [_allreduce_async(a, op, f"{base}.{i}", prescale_factor, postscale_factor,
                                              None, rt, members=len(arrays))
                              for i, a in enumerate(arrays)], rt)


def grouped_allreduce(arrays: Sequence, op=Average, name: Optional[str] = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      quorum: Optional[int] = None,
                      process_set=global_process_set) -> List[np.ndarray]:
    return submit_and_wait(grouped_allreduce_async, arrays, op, name, prescale_factor,
                            postscale_factor, quorum, process_set)


def allgather_async(array, name: Optional[str] = None, process_set=global_process_set) -> Handle:
    rt = runtime_for(process_set, "allgather")
    name = name or _auto_name("allgather", rt)
    arr = _as_array(array, name, Kind.ALLGATHER, rt)
    if arr.ndim == 0:
        raise InvalidCollectiveError(f"tensor '{name}': allgather needs at least one dimension, got a scalar")
    return _submit(Kind.ALLGATHER, arr, name, rt=rt)


def allgather(array, name: Optional[str] = None, process_set=global_process_set) -> np.ndarray:
    """Concatenate every rank's array along the first dimension (which may differ per rank),
    in rank order (set rank order on a process set)."""
    return synchronize(allgather_async(array, name, process_set))


def grouped_allgather_async(arrays: Sequence, name: Optional[str] = None,
                            process_set=global_process_set) -> Handle:
    """One handle for several allgathers, all submitted before any is awaited (so they
    negotiate in the same cycles); the result is the list of gathered arrays."""
    rt = runtime_for(process_set, "grouped_allgather")
    base = name or _auto_name("grouped_allgather", rt)
    return one_handle(base, [allgather_async(a, f"{base}.{i}", process_set)
                              for i, a in enumerate(arrays)], rt)


def grouped_allgather(arrays: Sequence, name: Optional[str] = None,
                      process_set=global_process_set) -> List[np.ndarray]:
    return synchronize(grouped_allgather_async(arrays, name, process_set))


def broadcast_async(array, root_rank: int, name: Optional[str] = None,
                    process_set=global_process_set) -> Handle:
    rt = runtime_for(process_set, "broadcast")
    name = name or _auto_name("broadcast", rt)
    arr = _as_array(array, name, Kind.BROADCAST, rt)
    root = int(root_rank)
    if rt.set_label:  # root_rank is a job rank, as in Horovod: the set's numbering travels
        if root not in rt.job_ranks:
            raise InvalidCollectiveError(
                f"tensor '{name}': broadcast root_rank {root} is not a member of {rt.set_label}")
        root = rt.job_ranks.index(root)
    return _submit(Kind.BROADCAST, arr, name, rt=rt, root=root)


def broadcast(array, root_rank: int, name: Optional[str] = None,
              process_set=global_process_set) -> np.ndarray:
    """Every rank gets root_rank's array (root_rank: the job rank, also on a process set)."""
    return synchronize(broadcast_async(array, root_rank, name, process_set))


def alltoall_async(array, splits=None, name: Optional[str] = None,
                   process_set=global_process_set) -> Handle:
    rt = runtime_for(process_set, "alltoall")
    name = name or _auto_name("alltoall", rt)
    arr = _as_array(array, name, Kind.ALLTOALL, rt)
    n = rt.size
    if arr.ndim == 0:
        raise InvalidCollectiveError(f"tensor '{name}': alltoall needs at least one dimension, got a scalar")
    if splits is None:
        if arr.shape[0] % n:
            raise InvalidCollectiveError(
                f"tensor '{name}': first dimension {arr.shape[0]} is not divisible by {n} ranks; "
                "pass splits to send uneven parts")
        rows = np.full(n, arr.shape[0] // n, dtype=np.int64)
        transform = lambda result: result[0]
    else:
        rows = _device.host_ints(splits)
        if rows.size != n or (rows < 0).any() or int(rows.sum()) != arr.shape[0]:
            raise InvalidCollectiveError(
                f"tensor '{name}': splits {rows.tolist()} must have {n} non-negative entries "
                f"summing to the first dimension {arr.shape[0]}")
        transform = None
    return _submit(Kind.ALLTOALL, arr, name, transform=transform, splits=rows, rt=rt)


def alltoall(array, splits=None, name: Optional[str] = None, process_set=global_process_set):
    """Send splits[i] rows to rank i (set rank i on a process set); returns the rows
    received, and their splits when splits are given."""
    return synchronize(alltoall_async(array, splits, name, process_set))


def reducescatter_async(array, op=Average, name: Optional[str] = None,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                        process_set=global_process_set) -> Handle:
    rt = runtime_for(process_set, "reducescatter")
    name = name or _auto_name("reducescatter", rt)
    op = _reduce_op(op, name)
    arr = _as_array(array, name, Kind.REDUCESCATTER, rt)
    if arr.ndim == 0:
        raise InvalidCollectiveError(f"tensor '{name}': reducescatter needs at least one dimension, got a scalar")
    pre, post = float(prescale_factor), float(postscale_factor)
    _check_scales(arr, name, pre, post)
    return _submit(Kind.REDUCESCATTER, arr, name, rt=rt, op=int(op), prescale=pre, postscale=post)


def reducescatter(array, op=Average, name: Optional[str] = None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                  process_set=global_process_set) -> np.ndarray:
    """Reduce over ranks, then rank r (set rank r on a process set) keeps the r-th part
    of the first dimension. The scale factors multiply the input and the reduced result,
    as allreduce's."""
    return synchronize(reducescatter_async(array, op, name, prescale_factor, postscale_factor,
                                           process_set))


def grouped_reducescatter_async(arrays: Sequence, op=Average, name: Optional[str] = None,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                                process_set=global_process_set) -> Handle:
    """One handle for several reducescatters, submitted together; results as a list."""
    rt = runtime_for(process_set, "grouped_reducescatter")
    base = name or _auto_name("grouped_reducescatter", rt)
    return one_handle(base, [reducescatter_async(a, op, f"{base}.{i}", prescale_factor,
                                                 postscale_factor, process_set)
                              for i, a in enumerate(arrays)], rt)


def grouped_reducescatter(arrays: Sequence, op=Average, name: Optional[str] = None,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          process_set=global_process_set) -> List[np.ndarray]:
    return synchronize(grouped_reducescatter_async(arrays, op, name, prescale_factor,
                                                   postscale_factor, process_set))


def barrier(process_set=global_process_set) -> None:
    """Return once every rank (of the process set) has called barrier()."""
    rt = runtime_for(process_set, "barrier")
    synchronize(_submit(Kind.BARRIER, None, _auto_name("barrier", rt), rt=rt))


def join_async() -> Handle:
    return _submit(Kind.JOIN, None, JOIN_NAME)


def join() -> int:
    """Wait for every rank to join; until then this rank adds zeros to others' allreduces.

    Returns the rank that joined last.
    """
    return synchronize(join_async())


def poll(handle: Handle) -> bool:
    """True once the collective behind `handle` has completed."""
    return handle.done()


def synchronize(handle: Handle):
    """Wait for the collective and return its result (or raise its error)."""
    return handle.result()
