"""The optional native wait op: built on first use, Python ops when it cannot be.

A Python op (`tf.numpy_function`) that waits holds one of TensorFlow's
inter-op threads until the collective is done, and can only fail with the
class TensorFlow picks from the Python type (InvalidArgumentError or
UnknownError). `async_wait.cc` is an AsyncOpKernel instead: it holds no thread
while it waits (so a TF1 session running many independent collectives cannot
run out of threads while another rank still needs one to enqueue), and fails
with the class Horovod raises (FailedPreconditionError for ranks that
disagree, InvalidArgumentError for bad arguments, AbortedError at shutdown).

It is compiled once per TensorFlow version with the C++ compiler TensorFlow's
own flags name (about 20 s), into `HOROLITE_TF_OPS_CACHE` (default
`~/.cache/horolite/tf_ops`), under a file lock so that the ranks of a job
build it once. If there is no compiler or the build fails, the reason is
logged once and the Python ops are used: installing and importing never
depend on it. `HOROLITE_TF_NATIVE_OPS=0` turns it off.
"""
from __future__ import annotations

import ctypes
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

import numpy as np
import tensorflow as tf

from horolite.core.config import env_value
from horolite.errors import (DuplicateNameError, InvalidCollectiveError, NotInitializedError,
                             ShutdownError, TensorMismatchError)

__all__ = ["load", "error_code", "NativeWait"]

_log = logging.getLogger("horolite.tensorflow")
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "async_wait.cc")

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


class NativeWait:
    """The loaded op library: `op(hid, dtypes)` builds a wait op, `complete`/`fail` feed it."""

    def __init__(self, path: str):
        self.module = tf.load_op_library(path)
        lib = ctypes.CDLL(path)
        self._complete = lib.horolit_complete
        self._complete.restype = None
        self._complete.argtypes = [
            ctypes.c_int64, ctypes.c_int, ctypes.c_char_p, ctypes.c_int,
            ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_void_p),
            ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.POINTER(ctypes.c_int64)),
            ctypes.POINTER(ctypes.c_int), ctypes.c_int64]
        self._released = lib.horolit_released
        self._released.restype = ctypes.c_int
        self._released.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.c_int]
        self._released_buf = (ctypes.c_int64 * 256)()
        # token -> the arrays behind results the op handed to TensorFlow without a copy,
        # kept until every tensor made from them is gone (then the output pool reuses them)
        self._lent = {}
        self._tokens = itertools.count(1)
        self._lent_lock = threading.Lock()
        self.path = path

    def op(self, hid, dtypes: Sequence[tf.DType]):
        return self.module.horolit_async_wait(hid, T=list(dtypes), name="HorolitWait")

    def fail(self, hid: int, exc: BaseException) -> None:
        msg = f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")
        self._complete(int(hid), error_code(exc), msg, 0, None, None, None, None, None, 0)

    def drain(self) -> None:
        """Drop the arrays of results TensorFlow no longer uses."""
        buf = self._released_buf
        while True:
            n = self._released(buf, len(buf))
            if not n:
                return
            with self._lent_lock:
                for token in buf[:n]:
                    self._lent.pop(token, None)

    def complete(self, hid: int, arrays: Sequence[np.ndarray]) -> None:
        """Hand the results to the wait op: 64-byte aligned ones as they are (the
        arrays are kept here until TensorFlow drops them), others copied."""
        arrays = [a if a.flags.c_contiguous else np.array(a, order="C") for a in arrays]  # (keeps 0-d)
        n = len(arrays)
        dtypes = (ctypes.c_int * n)(*[tf.as_dtype(a.dtype).as_datatype_enum for a in arrays])
        data = (ctypes.c_void_p * n)(*[a.ctypes.data for a in arrays])
        nbytes = (ctypes.c_int64 * n)(*[a.nbytes for a in arrays])
        dims = [(ctypes.c_int64 * max(a.ndim, 1))(*a.shape) for a in arrays]
        shapes = (ctypes.POINTER(ctypes.c_int64) * n)(
            *[ctypes.cast(d, ctypes.POINTER(ctypes.c_int64)) for d in dims])
        ndims = (ctypes.c_int * n)(*[a.ndim for a in arrays])
        token = next(self._tokens)
        with self._lent_lock:
            self._lent[token] = arrays
        self._complete(int(hid), 0, None, n, dtypes, data, nbytes, shapes, ndims, token)
        self.drain()


_lock = threading.Lock()
_loaded: Optional[NativeWait] = None
_tried = False


def _enabled() -> bool:
    return (env_value("TF_NATIVE_OPS") or "1").strip().lower() not in ("0", "false", "no", "off")


def _cache_dir() -> str:
    base = env_value("TF_OPS_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "horolite", "tf_ops")
    flags = tf.sysconfig.get_compile_flags() + tf.sysconfig.get_link_flags()
    digest = hashlib.sha256(open(_SOURCE, "rb").read() + " ".join(flags).encode()).hexdigest()[:16]
    return os.path.join(base, f"tf{tf.__version__}-{digest}")


def _build(directory: str) -> str:
    """Compile async_wait.cc into directory (once, under a lock); returns the library's path."""
    os.makedirs(directory, exist_ok=True)
    target = os.path.join(directory, "async_wait.so")
    with open(os.path.join(directory, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(target):
            return target
        cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
        if cxx is None:
            raise RuntimeError("no C++ compiler (g++) on PATH")
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
        os.close(fd)
        cmd = [cxx, "-shared", "-fPIC", "-O2", "-w", _SOURCE, "-o", tmp,
               *tf.sysconfig.get_compile_flags(), *tf.sysconfig.get_link_flags()]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            os.unlink(tmp)
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
        os.replace(tmp, target)
        _log.info("built the native wait op: %s", target)
    return target


def load() -> Optional[NativeWait]:
    """The native wait op, building it on the first call; None when it cannot be had."""
    global _loaded, _tried
    if _tried:
        return _loaded
    with _lock:
        if _tried:
            return _loaded
        if _enabled():
            try:
                _loaded = NativeWait(_build(_cache_dir()))
            except Exception as e:  # any failure: fall back to the Python ops
                _log.warning("horolite: the native TensorFlow wait op is not available (%s); "
                             "using Python ops, which raise InvalidArgumentError/UnknownError for "
                             "the runtime's errors inside graphs", (str(e) or repr(e)).splitlines()[0])
                _log.debug("native wait op build: %s", e)
        _tried = True
    return _loaded
