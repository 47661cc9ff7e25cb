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


FALLBACK_SCRIPT = r"""
import numpy as np, tensorflow as tf
import horolite.tensorflow as hvd
hvd.init()
fn = tf.function(lambda t: [hvd.allreduce(t * k, op=hvd.Sum) for k in (1.0, 2.0)])
x = tf.constant(np.arange(6, dtype=np.float32))
types = {op.type for op in fn.get_concrete_function(x).graph.get_operations()}
assert not types & {"HorolitEnqueue", "HorolitAsyncWait"} and types & {"PyFunc", "EagerPyFunc"}, types
a, b = fn(x)
np.testing.assert_array_equal(a.numpy(), np.arange(6))
np.testing.assert_array_equal(b.numpy(), 2 * np.arange(6))
print("fallback ok")
"""


def test_without_a_compiler_the_python_ops_run_and_one_warning_says_why(tmp_path):
    # A single process (a job of one rank): the ops are built at the first tf.function.
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if not k.endswith("TF_NATIVE_OPS")}
    env.update(CXX=str(tmp_path / "no-such-compiler"), HOROLITE_TF_OPS_CACHE=str(tmp_path / "ops"),
               TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run([sys.executable, "-c", FALLBACK_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0 and "fallback ok" in proc.stdout, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if "native TensorFlow" in line]
    assert len(said) == 1 and "no-such-compiler" in said[0], proc.stderr[-3000:]
