"""The native TensorFlow ops: built on first use, Python ops when they cannot be.

Two ops make each collective in a graph. `enqueue_op.cc` hands the input
tensors to the runtime without Python on TensorFlow's thread: it keeps them by
reference, queues one item and wakes the background thread, which reads them
where they lie (intake.py). `async_wait.cc` waits for the result without
holding a TensorFlow thread (so a TF1 session running many independent
collectives cannot run out of threads while another rank still needs one to
enqueue), hands it over without a copy, and fails with the class Horovod raises
(FailedPreconditionError for ranks that disagree, InvalidArgumentError for bad
arguments, AbortedError at shutdown). The Python ops they replace
(`tf.numpy_function`) cost a conversion, a copy and the GIL per collective on
TensorFlow's thread, and can only fail with the class TensorFlow picks from the
Python type (InvalidArgumentError or UnknownError).

They are compiled once per TensorFlow version with the C++ compiler TensorFlow's
own flags name (about 20 s), into `HOROLITE_TF_OPS_CACHE` (default
`~/.cache/horolite/tf_ops`), under a file lock so that the ranks of a job
build it once. If there is no compiler or the build fails, the reason is
logged once and the Python ops are used: installing and importing never
depend on it. `HOROLITE_TF_NATIVE_OPS=0` turns it off.
"""
from __future__ import annotations

import fcntl
import hashlib
import itertools
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from typing import Optional, Sequence

import cffi
import numpy as np
import tensorflow as tf

from horolite.core.config import env_value
from horolite.errors import (DuplicateNameError, InvalidCollectiveError, NotInitializedError,
                             ShutdownError, TensorMismatchError)

__all__ = ["load", "error_code", "NativeOps"]

_log = logging.getLogger("horolite.tensorflow")
_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCES = [os.path.join(_HERE, name) for name in ("async_wait.cc", "enqueue_op.cc")]

# TensorFlow's status codes (tensorflow/core/protobuf/error_codes.proto).
_INVALID_ARGUMENT, _FAILED_PRECONDITION, _ABORTED, _UNKNOWN = 3, 9, 10, 2


def error_code(exc: BaseException) -> int:
    """The TensorFlow status code Horovod uses for a runtime error."""
    if isinstance(exc, ShutdownError):
        return _ABORTED
    if isinstance(exc, InvalidCollectiveError):
        return _INVALID_ARGUMENT
    if isinstance(exc, (TensorMismatchError, DuplicateNameError, NotInitializedError)):
        return _FAILED_PRECONDITION
    return _FAILED_PRECONDITION if isinstance(exc, ValueError) else _UNKNOWN


_CDEF = """
typedef struct {
  int64_t hid; int64_t spec; int32_t n; const int32_t *dtypes; char *const *data;
  const int64_t *nbytes; const int32_t *ndims; const int64_t *dims; int64_t enqueued_ns;
} horolit_item;
void horolit_complete(int64_t hid, int code, const char *message, int n, const int *dtypes,
                      const char *const *data, const int64_t *nbytes,
                      const int64_t *dims, const int *ndims, int64_t token);
int horolit_released(int64_t *out, int cap);
void horolit_set_ring(void (*fn)(void *), void *arg);
void horolit_close(int code, const char *message);
int horolit_take(horolit_item *out, int cap);
int horolit_pending(void);
void horolit_drop_inputs(int64_t hid);
"""


class NativeOps:
    """The loaded op library: `enqueue(tensors, spec)` and `op(hid, dtypes)` build the two
    ops; `take` gives the background thread what enqueue ops queued; `complete`/`fail`
    feed the wait ops. Its C interface is called through cffi (one documented set of
    functions, above), which costs a fraction of a microsecond per call."""

    TAKE = 256  # items per horolit_take call

    def __init__(self, path: str):
        self.module = tf.load_op_library(path)
        self.ffi = cffi.FFI()
        self.ffi.cdef(_CDEF)
        self.lib = self.ffi.dlopen(path)
        self._released_buf = self.ffi.new("int64_t[]", 256)
        self._items = self.ffi.new("horolit_item[]", self.TAKE)
        # token -> the arrays behind results the op handed to TensorFlow without a copy,
        # kept until every tensor made from them is gone (then the output pool reuses them)
        self._lent = {}
        self._tokens = itertools.count(1)
        self._lent_lock = threading.Lock()
        self.path = path

    def op(self, hid, dtypes: Sequence[tf.DType]):
        return self.module.horolit_async_wait(hid, T=list(dtypes), name="HorolitWait")

    def enqueue(self, tensors: Sequence[tf.Tensor], spec: int):
        return self.module.horolit_enqueue(list(tensors), spec=spec, name="HorolitEnqueue")

    def set_ring(self, address: int, function: int) -> None:
        """Enqueue ops call function(address) after queueing; 0, 0: they fail instead."""
        ffi = self.ffi
        self.lib.horolit_set_ring(ffi.cast("void (*)(void *)", function),
                                  ffi.cast("void *", address))

    def close(self, exc: BaseException) -> None:
        """Enqueue ops fail with exc (as the class Horovod raises) until set_ring again."""
        self.lib.horolit_close(error_code(exc),
                               f"{type(exc).__name__}: {exc}".encode("utf-8", "replace"))

    def take(self) -> list:
        """What enqueue ops queued since the last call: horolit_item structs, whose
        pointers stay valid until the collective completes (or fails)."""
        items, out, new = self._items, [], self.ffi.new
        while True:
            n = self.lib.horolit_take(items, self.TAKE)
            # (each struct copied out before the next call reuses the buffer)
            out.extend(new("horolit_item *", items[i]) for i in range(n))
            if n < self.TAKE:
                return out

    def fail(self, hid: int, exc: BaseException, code: Optional[int] = None) -> None:
        """The wait op of hid raises exc, as the class Horovod raises (or as `code`)."""
        msg = f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")
        ffi = self.ffi
        self.lib.horolit_complete(int(hid), error_code(exc) if code is None else code, msg,
                                  0, ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL, 0)

    def drain(self) -> None:
        """Drop the arrays of results TensorFlow no longer uses."""
        buf = self._released_buf
        while True:
            n = self.lib.horolit_released(buf, 256)
            if not n:
                return
            with self._lent_lock:
                for token in buf[0:n]:
                    self._lent.pop(token, None)

    def complete(self, hid: int, arrays: Sequence[np.ndarray]) -> None:
        """Hand the results to the wait op: 64-byte aligned ones as they are (the
        arrays are kept here until TensorFlow drops them), others copied."""
        arrays = [a if a.flags.c_contiguous else np.array(a, order="C") for a in arrays]  # (keeps 0-d)
        from_buffer, null = self.ffi.from_buffer, self.ffi.NULL
        token = next(self._tokens)
        with self._lent_lock:
            self._lent[token] = arrays
        dims = []
        for a in arrays:
            dims.extend(a.shape)
        self.lib.horolit_complete(
            int(hid), 0, null, len(arrays), [_dtype_enum(a.dtype) for a in arrays],
            [from_buffer(a) if a.nbytes else null for a in arrays],
            [a.nbytes for a in arrays], dims or [0], [a.ndim for a in arrays], token)


_DTYPE_ENUMS: dict = {}


def _dtype_enum(dtype: np.dtype) -> int:
    code = _DTYPE_ENUMS.get(dtype)
    if code is None:
        code = _DTYPE_ENUMS[dtype] = tf.as_dtype(dtype).as_datatype_enum
    return code


_lock = threading.Lock()
_loaded: Optional[NativeOps] = None
_tried = False


def _enabled() -> bool:
    return (env_value("TF_NATIVE_OPS") or "1").strip().lower() not in ("0", "false", "no", "off")


def _cache_dir() -> str:
    base = env_value("TF_OPS_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "horolite", "tf_ops")
    flags = tf.sysconfig.get_compile_flags() + tf.sysconfig.get_link_flags()
    sources = b"".join(open(path, "rb").read() for path in _SOURCES)
    digest = hashlib.sha256(sources + " ".join(flags).encode()).hexdigest()[:16]
    return os.path.join(base, f"tf{tf.__version__}-{digest}")


def _build(directory: str) -> str:
    """Compile the ops (async_wait.cc, enqueue_op.cc) into directory (once, under a lock); returns the library's path."""
    os.makedirs(directory, exist_ok=True)
    target = os.path.join(directory, "horolite_ops.so")
    with open(os.path.join(directory, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(target):
            return target
        cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
        if cxx is None:
            raise RuntimeError("no C++ compiler (g++) on PATH")
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
        os.close(fd)
        cmd = [cxx, "-shared", "-fPIC", "-O2", "-w", *_SOURCES, "-o", tmp,
               *tf.sysconfig.get_compile_flags(), *tf.sysconfig.get_link_flags()]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            os.unlink(tmp)
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
        os.replace(tmp, target)
        _log.info("built the native TensorFlow ops: %s", target)
    return target


def load() -> Optional[NativeOps]:
    """The native wait op, building it on the first call; None when it cannot be had."""
    global _loaded, _tried
    if _tried:
        return _loaded
    with _lock:
        if _tried:
            return _loaded
        if _enabled():
            try:
                _loaded = NativeOps(_build(_cache_dir()))
            except Exception as e:  # any failure: fall back to the Python ops
                _log.warning("horolite: the native TensorFlow ops are not available (%s); "
                             "using Python ops (slower: Python on TensorFlow's thread per "
                             "collective), which raise InvalidArgumentError/UnknownError for "
                             "the runtime's errors inside graphs", (str(e) or repr(e)).splitlines()[0])
                _log.debug("native ops build: %s", e)
        _tried = True
    return _loaded
