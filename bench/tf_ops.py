"""TensorFlow's collectives against the NumPy API on the same arrays, same run.

200 float32 tensors of 1000 values (one TensorFlow thread per process):
- the NumPy API: one grouped_allreduce, and a synchronous allreduce per tensor;
- in a tf.function: one hvd.allreduce per tensor (Horovod's classic loop), and one
  hvd.grouped_allreduce of all of them;
- eagerly: one hvd.allreduce per tensor;
- DistributedGradientTape in a tf.function over 200 such variables, against the same
  step with a plain tape.
A tf.function that takes 200 tensors and returns 200 costs TensorFlow milliseconds
by itself, collectives or not: the same function with tf.identity in place of the
collective is timed too, and "horolite's share" is the time above it.

    horolite-run -np 2 python bench/tf_ops.py
"""
from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import common  # noqa: E402
from common import Target  # noqa: E402


def main(argv=None) -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--tensors", type=int, default=200)
    p.add_argument("--values", type=int, default=1000)
    p.add_argument("--iters", type=int, default=60)
    args = p.parse_args(argv)
    if args.tiny:
        args.tensors, args.iters = 10, 4

    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    from mpi4py import MPI
    import horolite as hl
    import horolite.tensorflow as hvd
    from horolite.tensorflow import native_ops

    hvd.init()
    comm = MPI.COMM_WORLD
    common.wait_until_quiet(comm, args.quiet_below, args.quiet_timeout)
    n = args.tensors
    arrays = [np.full(args.values, i + hvd.rank(), np.float32) for i in range(n)]
    tensors = [tf.constant(a) for a in arrays]
    names = [f"np.{i}" for i in range(n)]
    eager_names = [f"eager.{i}" for i in range(n)]

    per_tensor = tf.function(lambda ts: [hvd.allreduce(t) for t in ts])
    grouped = tf.function(lambda ts: hvd.grouped_allreduce(ts))
    identity = tf.function(lambda ts: [tf.identity(t) for t in ts])

    variables = [tf.Variable(np.zeros(args.values, np.float32)) for _ in range(n)]

    def tape_step(distributed: bool):
        @tf.function
        def step(ts):
            with tf.GradientTape() as tape:
                loss = tf.add_n([tf.reduce_sum(v * t) for v, t in zip(variables, ts)])
            if distributed:
                tape = hvd.DistributedGradientTape(tape)
            return tf.add_n([tf.reduce_sum(g) for g in tape.gradient(loss, variables)])
        return lambda: step(tensors).numpy()

    fns = {
        "numpy_grouped": lambda: hl.grouped_allreduce(arrays, name="np.group"),
        "numpy_loop": lambda: [hl.allreduce(a, name=nm) for a, nm in zip(arrays, names)],
        "tf_per_tensor": lambda: per_tensor(tensors),
        "tf_grouped": lambda: grouped(tensors),
        "tf_identity": lambda: identity(tensors),
        "tf_eager_loop": lambda: [hvd.allreduce(t, name=nm) for t, nm in zip(tensors, eager_names)],
        "tape_plain": tape_step(False),
        "tape_distributed": tape_step(True),
    }
    for fn in fns.values():
        fn()
    t = common.interleaved_median_times(fns, args.iters, comm=comm)

    np_group, np_loop = t["numpy_grouped"], t["numpy_loop"]
    share = {k: t[k] - t["tf_identity"] for k in ("tf_per_tensor", "tf_grouped")}
    eager_over_us = (t["tf_eager_loop"] - np_loop) / n * 1e6
    tape_added = t["tape_distributed"] - t["tape_plain"]
    tape_per_tensor_us = (tape_added - np_group) / n * 1e6
    native = native_ops.load() is not None
    rows = [[k, f"{v * 1e3:.3f}"] for k, v in t.items()]
    rows += [["tf.function per tensor: horolite's share (above identity)",
              f"{share['tf_per_tensor'] * 1e3:.3f}"],
             ["tf.function grouped: horolite's share (above identity)",
              f"{share['tf_grouped'] * 1e3:.3f}"],
             ["DistributedGradientTape: added to a plain tape step", f"{tape_added * 1e3:.3f}"]]
    tf_io = "TensorFlow's own cost of a tf.function with 200 tensors in and out (tf_identity)"
    targets = [
        Target("tf.function, one allreduce per tensor / NumPy grouped", t["tf_per_tensor"] / np_group,
               1.5, "x", False, tf_io),
        Target("the same, horolite's share / NumPy grouped", share["tf_per_tensor"] / np_group,
               1.5, "x", False, "per-tensor requests: one negotiation entry and one wait op each"),
        Target("tf.function, one grouped allreduce / NumPy grouped", t["tf_grouped"] / np_group,
               1.3, "x", False, tf_io),
        Target("the same, horolite's share / NumPy grouped", share["tf_grouped"] / np_group,
               1.3, "x", False, "reading 200 inputs and handing over 200 results in Python"),
        Target("eager allreduce: above the NumPy API's synchronous call", eager_over_us, 60.0,
               "us per op", False, "TensorFlow's eager dispatch and the front end's checks"),
        Target("DistributedGradientTape: per tensor beyond the NumPy exchange", tape_per_tensor_us,
               5.0, "us", False, "the tape's own Python per gradient"),
    ]
    payload = {"seconds": t, "tensors": n, "values": args.values, "native_ops": native,
               "share_s": share, "eager_over_numpy_us_per_op": eager_over_us,
               "tape_added_s": tape_added, "tape_us_per_tensor_beyond_numpy": tape_per_tensor_us}
    common.finish(comm, args, "tf_ops", payload, ["what", "ms"], rows, targets)


if __name__ == "__main__":
    main()
