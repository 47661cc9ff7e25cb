"""The background thread's side of the native enqueue op.

An enqueue op (enqueue_op.cc) queues its inputs in C and wakes the global
runtime's background thread. At the start of its next cycle that thread takes
the queued items (`Intake.take`, the queue's intake), reads each input where
TensorFlow keeps it (no copy: the op holds the tensors until the collective is
done), and submits it as the op's spec says. When the handle is done its
results, or its error, go to the wait op (native_ops.NativeOps.complete/fail),
which also releases the inputs. Python runs on the background thread, never on
TensorFlow's.

A spec is the submit function of one enqueue op in a graph, registered when the
op is built: `register(submit) -> spec id`, the op's attribute.
"""
from __future__ import annotations

import itertools
import threading
import time
from typing import Callable, Dict, List

import numpy as np
import tensorflow as tf

from horolite.coordination.tensor_queue import NATIVE
from horolite.errors import HorovodInternalError, NotInitializedError
from horolite.runtime import registry

from .native_ops import NativeOps
from .traced_groups import Member

__all__ = ["Intake", "intake_for", "submit_to_wait_op"]

_ABANDONED = HorovodInternalError("the step was cancelled before every collective of its group "
                                  "was enqueued")


def _python_op_code(exc: BaseException) -> int:
    """The status a Python op raising exc failed with (what TensorFlow's py_func picks)."""
    return 3 if isinstance(exc, (TypeError, ValueError)) else 2


class Intake:
    def __init__(self, native: NativeOps):
        self.native = native
        self._specs: Dict[int, Callable] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._dtypes: Dict[int, np.dtype] = {}
        self._buffer = native.ffi.buffer
        self._unpack = native.ffi.unpack
        self._queue = None
        # Traced-group members this thread held for a later member, and members of an
        # abandoned run it dropped (tests read them: what the groups did, not how traced)
        self.held = self.dropped = 0
        registry.add_intake(self)

    def register(self, submit) -> int:
        """A spec id for an enqueue op whose inputs go to submit(*arrays) -> Handle, or
        to a traced_groups.Member's submit once its whole group has come."""
        with self._lock:
            spec = next(self._ids)
            self._specs[spec] = submit
        return spec

    # ---- the runtime's side (registry.add_intake) ----
    def attach(self, queue) -> None:
        """Feed `queue` (the global runtime's, at init): its wake-up is what the ops ring."""
        self._queue = queue
        queue.intake = self
        self.native.set_ring(queue.wake.address, queue.wake.set_function())

    def detach(self, error: BaseException) -> None:
        """The global runtime is gone (shutdown): ops fail from now on ("not initialized"),
        and so do items still queued."""
        self.native.set_ring(0, 0)
        queue, self._queue = self._queue, None
        if queue is not None:
            queue.intake = None
        for item in self.native.take():
            self.native.fail(item.hid, error)

    def close(self, error: BaseException) -> None:
        """The runtime can take no more work (a failed rank, a stall): every op enqueued
        from now on fails with `error`, and so do the items queued, as the runtime's own
        pending collectives do."""
        self.native.close(error)
        for item in self.native.take():
            self.native.fail(item.hid, error)

    def take(self) -> None:
        """Submit what the ops queued (on the background thread, once per cycle)."""
        items = self.native.take()
        if not items:
            return
        native = self.native
        native.drain()  # results TensorFlow is done with, back to the output pool
        specs = self._specs
        rt = registry.current()
        timeline = rt.timeline if rt is not None and rt.timeline.enabled else None
        try:
            for item in items:
                try:
                    arrays = self._arrays(item)
                except BaseException as e:  # noqa: BLE001 - every error goes to the wait op
                    native.fail(item.hid, e, _python_op_code(e))
                    continue
                # The rank was ready when the op ran, not when this thread took the item
                # (a cycle, or a control round, later): the straggler record's time. Both
                # clocks are CLOCK_MONOTONIC (enqueue_op.cc, time.monotonic).
                NATIVE.since = ran = item.enqueued_ns * 1e-9
                spec = specs[item.spec]
                if spec.__class__ is not Member:
                    handle = submit_to_wait_op(native, item.hid, spec, arrays)
                    if timeline is not None and handle is not None:
                        # from the op running (its inputs had just been computed) to this take
                        timeline.span(handle.name, "ENQUEUE", ran, time.monotonic())
                    continue
                # (a group is ready when its last member's op ran: this one)
                ready, stale = spec.group.collect(spec.index, (item.hid, spec.submit, arrays))
                self.held += ready is None
                self.dropped += len(stale)
                for hid, _, _ in stale:  # (their wait ops were cancelled with their step)
                    native.fail(hid, _ABANDONED)
                for hid, submit, member_arrays in ready or ():
                    submit_to_wait_op(native, hid, submit, member_arrays)
        finally:
            NATIVE.since = 0.0  # this thread's own submits stamp themselves

    def pending(self) -> bool:
        return bool(self.native.lib.horolit_pending())

    def _arrays(self, item) -> List[np.ndarray]:
        """The op's inputs as NumPy arrays on TensorFlow's memory (each field read out of
        the item in one call: a cffi access per member and field costs more than the rest)."""
        n, unpack, buffer, frombuffer = item.n, self._unpack, self._buffer, np.frombuffer
        ndims, codes = unpack(item.ndims, n), unpack(item.dtypes, n)
        sizes, data = unpack(item.nbytes, n), unpack(item.data, n)
        total = sum(ndims)
        dims = unpack(item.dims, total) if total else ()  # (NULL when every input is a scalar)
        dtypes, arrays, offset = self._dtypes, [], 0
        for ndim, code, nbytes, ptr in zip(ndims, codes, sizes, data):
            dtype = dtypes.get(code)
            if dtype is None:
                dtype = dtypes[code] = np.dtype(tf.dtypes.as_dtype(code).as_numpy_dtype)
            if ndim == 1:
                shape = (dims[offset],)
            else:
                shape = tuple(dims[offset:offset + ndim])
            offset += ndim
            if nbytes:
                arrays.append(frombuffer(buffer(ptr, nbytes), dtype).reshape(shape))
            else:
                arrays.append(np.empty(shape, dtype))
        return arrays


def submit_to_wait_op(native: NativeOps, hid: int, submit: Callable, arrays):
    """submit(*arrays); the handle's results, or the error (even one raised by submit),
    reach wait op hid. Errors other than the runtime's fail it with the status a Python
    op raising them would have had. Returns the handle (None if submit raised)."""
    try:
        handle = submit(*arrays)
    except (HorovodInternalError, NotInitializedError) as e:
        native.fail(hid, e)
        return None
    except Exception as e:  # noqa: BLE001 - on the background thread: never raised there
        native.fail(hid, e, _python_op_code(e))
        return None
    handle.add_done_callback(lambda h: _deliver(native, hid, h))
    return handle


def _deliver(native: NativeOps, hid: int, handle) -> None:
    try:
        result = handle.result()
    except BaseException as e:  # noqa: BLE001 - the runtime's error travels to the wait op
        native.fail(hid, e)
        return
    if isinstance(result, (list, tuple)):
        arrays, dims = list(result), handle.first_dims
    else:
        arrays, dims = [result], None if handle.first_dims is None else [handle.first_dims]
    if dims is not None:  # allgathers: every rank's first dimension too (see bridge.wait)
        arrays += [np.asarray(d, np.int64) for d in dims]
    native.complete(hid, [np.asarray(a) for a in arrays])


_intake = None
_intake_lock = threading.Lock()


def intake_for(native: NativeOps) -> Intake:
    """The process's one intake (made on first use)."""
    global _intake
    with _intake_lock:
        if _intake is None:
            _intake = Intake(native)
        return _intake
