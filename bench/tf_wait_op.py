"""The native TensorFlow ops (enqueue and wait) against the Python (numpy_function) ops, same run.

Inside a tf.function, per call: one allreduce of a 4 KiB tensor, and a grouped
allreduce of 20 such tensors; in a TF1 session, one run of 20 independent
allreduces (which needs as many inter-op threads as collectives with Python
waits, and none with the native op: so that variant gives the Python waits 32
threads). Both variants are traced in the same process, the Python one with the
native op switched off while it is traced. Also the native op's one-time build
(compile against the installed TensorFlow, into a fresh cache directory).

    horolite-run -np 2 python bench/tf_wait_op.py
"""
from __future__ import annotations

import os
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from mpi4py import MPI  # noqa: E402

import common  # noqa: E402
from common import Target  # noqa: E402

import horolite.tensorflow as hvd  # noqa: E402
from horolite.tensorflow import native_ops  # noqa: E402


class _python_waits:
    """While active, graphs get the Python ops (as without a compiler)."""

    def __enter__(self):
        self.saved = native_ops._loaded, native_ops._tried
        native_ops._loaded, native_ops._tried = None, True

    def __exit__(self, *exc):
        native_ops._loaded, native_ops._tried = self.saved


def session_step(count: int, threads: int):
    graph = tf.Graph()
    with graph.as_default():
        outs = [hvd.allreduce(tf.constant(np.full(1024, i, np.float32)), op=hvd.Sum, name=f"s{i}")
                for i in range(count)]
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=threads,
                                      use_per_session_threads=True)
    sess = tf.compat.v1.Session(graph=graph, config=config)
    return lambda: sess.run(outs)


def main(argv=None) -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=400)
    args = p.parse_args(argv)
    if args.tiny:
        args.iters = 8
    hvd.init()
    comm = MPI.COMM_WORLD
    common.wait_until_quiet(comm, args.quiet_below, args.quiet_timeout)
    assert native_ops.load() is not None, "the native ops could not be built here"

    x = tf.constant(np.ones(1024, np.float32))
    xs = [tf.constant(np.full(1024, i, np.float32)) for i in range(20)]
    one = {}
    group = {}
    sessions = {}
    for variant in ("native", "python"):
        ctx = _python_waits() if variant == "python" else None
        if ctx:
            ctx.__enter__()
        one[variant] = tf.function(lambda: hvd.allreduce(x, name=f"one.{variant}"))
        group[variant] = tf.function(lambda: hvd.grouped_allreduce(xs, name=f"grp.{variant}"))
        one[variant]()
        group[variant]()
        sessions[variant] = session_step(20, 32 if variant == "python" else 2)
        sessions[variant]()
        if ctx:
            ctx.__exit__()
    rows, payload, targets = [], {}, []
    for label, fns in (("tf.function, 1 x 4 KiB allreduce", one),
                       ("tf.function, grouped 20 x 4 KiB", group),
                       ("TF1 session.run, 20 independent 4 KiB allreduces", sessions)):
        t = common.interleaved_median_times(fns, args.iters, comm=comm)
        ratio = t["native"] / t["python"]
        rows.append([label, f"{t['native'] * 1e3:.3f}", f"{t['python'] * 1e3:.3f}", f"{ratio:.2f}"])
        payload[label] = {"native_s": t["native"], "python_s": t["python"], "ratio": ratio}
        targets.append(Target(f"{label}: native / python time", ratio, 1.0, "x", False,
                              "the machine's load"))

    build_s = None
    if not args.tiny and comm.Get_rank() == 0:
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            native_ops._build(d)
            build_s = time.perf_counter() - t0
        rows.append(["one-time build of the native op", f"{build_s:.1f} s", "-", "-"])
    payload["build_seconds"] = build_s
    common.finish(comm, args, "tf_wait_op", payload,
                  ["what", "native ms", "python ms", "native / python"], rows, targets)


if __name__ == "__main__":
    main()
