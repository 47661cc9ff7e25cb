"""The native TensorFlow ops (enqueue and wait) build and load wherever TensorFlow and a C++ compiler are.

Where it cannot be built, horolite falls back to Python wait ops and only logs why: a
user loses nothing that fails. This test is what makes a broken build fail the suite
instead (the rank-side TensorFlow files then expect the native op, tests/tensorflow/
tf_modes.py). It skips only where TensorFlow or the compiler is truly absent.
"""
import os
import shutil

import pytest

tf = pytest.importorskip("tensorflow")


def test_the_native_ops_build_from_source_and_load(tmp_path, monkeypatch):
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler (g++ or c++) on PATH: horolite uses the Python wait ops")
    from horolite.tensorflow import native_ops
    # A fresh cache: compiled from async_wait.cc and enqueue_op.cc now, not a library an earlier run left.
    monkeypatch.setenv("HOROLITE_TF_OPS_CACHE", str(tmp_path))
    monkeypatch.delenv("HOROLITE_TF_NATIVE_OPS", raising=False)
    monkeypatch.delenv("HOROVOD_TF_NATIVE_OPS", raising=False)
    path = native_ops._build(native_ops._cache_dir())  # raises with the compiler's output
    assert path.startswith(str(tmp_path)) and os.path.getsize(path) > 0
    ops = native_ops.NativeOps(path)
    with tf.Graph().as_default() as graph:  # built, not run: nobody completes handle 7
        hid = ops.enqueue([tf.constant([1.0]), tf.constant(2)], spec=1)
        outputs = ops.op(tf.constant(7, tf.int64), [tf.float32, tf.int32])
    assert hid.dtype == tf.int64 and hid.shape == []
    assert [t.dtype for t in outputs] == [tf.float32, tf.int32]
    assert {"HorolitAsyncWait", "HorolitEnqueue"} <= {op.type for op in graph.get_operations()}
    # and the runtime's loader takes it (it would fall back silently otherwise)
    monkeypatch.setattr(native_ops, "_tried", False)
    monkeypatch.setattr(native_ops, "_loaded", None)
    assert native_ops.load() is not None
