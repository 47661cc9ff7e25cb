"""A traced step that reads the world's size and rank when it runs, against the same step
with them written in as constants (horolite's code before elastic jobs needed the former).

Both functions are traced in this process from the same Python: the constant one while
horolite.tensorflow.world_values is told it is outside a tf.function, which is the path
that writes `tf.constant(size())` into the graph. Timed interleaved, in the same run:
- the step: a DistributedGradientTape step over an embedding (tf.gather: IndexedSlices
  gradients, averaged over the ranks), a dense layer and a variable whose gradient stays
  local (register_local_source: divided by size()), the learning rate scaled by
  hvd.size_op(), and hvd.rank_op() picking the rows;
- the reads alone: a tf.function that multiplies a scalar by size_op() and rank_op().
Ratios are medians of per-block ratios (blocks alternate the ways, ABBA).

    horolite-run -np 2 python bench/world_values.py
"""
from __future__ import annotations

import contextlib
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import common  # noqa: E402
from common import Target  # noqa: E402


def main(argv=None) -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--iters", type=int, default=400)
    p.add_argument("--blocks", type=int, default=8)
    args = p.parse_args(argv)
    if args.tiny:
        args.rows, args.iters, args.blocks = 100, 8, 2

    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    from mpi4py import MPI
    import horolite.tensorflow as hvd
    from horolite.tensorflow import native_ops, world_values

    hvd.init()
    comm = MPI.COMM_WORLD
    common.wait_until_quiet(comm, args.quiet_below, args.quiet_timeout)
    rng = np.random.default_rng(hvd.rank())
    emb = tf.Variable(rng.standard_normal((args.rows, args.width)).astype(np.float32))
    dense = tf.Variable(rng.standard_normal((args.width, 1)).astype(np.float32))
    local = tf.Variable(np.ones(args.width, np.float32))
    ids = tf.constant(rng.integers(0, args.rows, args.batch).astype(np.int32))
    y = tf.constant(rng.standard_normal((args.batch, 1)).astype(np.float32))

    def make_step():
        @tf.function
        def step(ids, y):
            picked = tf.gather(ids, tf.range(hvd.rank_op(), tf.size(ids), hvd.size_op()))
            with tf.GradientTape() as tape:
                h = tf.gather(emb, picked) * local
                loss = tf.reduce_mean((h @ dense - tf.gather(y, tf.range(
                    hvd.rank_op(), tf.size(ids), hvd.size_op()))) ** 2)
            tape = hvd.DistributedGradientTape(tape)
            tape.register_local_source(local)
            g_emb, g_dense, g_local = tape.gradient(loss, [emb, dense, local])
            lr = 0.001 * tf.cast(hvd.size_op(), tf.float32)
            emb.scatter_sub(tf.IndexedSlices(g_emb.values * lr, g_emb.indices, g_emb.dense_shape))
            dense.assign_sub(lr * g_dense)
            local.assign_sub(lr * g_local)
            return loss
        return step

    def make_reads():
        @tf.function
        def reads(x):
            return x * tf.cast(hvd.size_op() + hvd.rank_op(), tf.float32)
        return reads

    @contextlib.contextmanager
    def as_constants():
        """Trace with the world's values written in as constants (the previous path)."""
        saved = world_values._traced_in_eager_program
        world_values._traced_in_eager_program = lambda: False
        try:
            yield
        finally:
            world_values._traced_in_eager_program = saved

    live_step, const_step = make_step(), make_step()
    live_reads, const_reads = make_reads(), make_reads()
    x = tf.constant(1.0)
    live_step.get_concrete_function(ids, y)
    live_reads.get_concrete_function(x)
    with as_constants():
        const_step.get_concrete_function(ids, y)
        const_reads.get_concrete_function(x)
    ops = {name: {op.type for op in fn.get_concrete_function(*a).graph.get_operations()}
           for name, fn, a in (("live", live_reads, (x,)), ("constant", const_reads, (x,)))}
    assert "ReadVariableOp" in ops["live"] and "ReadVariableOp" not in ops["constant"], ops

    fns = {
        "step_constant": lambda: const_step(ids, y).numpy(),
        "step_live": lambda: live_step(ids, y).numpy(),
        "reads_constant": lambda: const_reads(x).numpy(),
        "reads_live": lambda: live_reads(x).numpy(),
    }
    for fn in fns.values():
        fn()
    # Blocks of each way in turn, the order reversed every other block (ABBA: a load that
    # drifts over a block charges both ways alike); each ratio is the median of the
    # blocks' own ratios, so a busy second of the shared machine moves one block only.
    per = max(1, -(-args.iters // args.blocks))
    blocks = {name: [] for name in fns}
    for b in range(args.blocks):
        for name in (list(fns) if b % 2 == 0 else list(fns)[::-1]):
            blocks[name].append(float(np.median(common._times(fns[name], per, 1, comm))))
    t = {name: float(np.median(v)) for name, v in blocks.items()}
    step_ratio = float(np.median(np.array(blocks["step_live"]) / np.array(blocks["step_constant"])))
    reads_us = float(np.median(np.array(blocks["reads_live"]) -
                               np.array(blocks["reads_constant"]))) * 1e6
    rows = [[k, f"{v * 1e3:.4f}"] for k, v in t.items()]
    rows += [["step: live / constant", f"{step_ratio:.3f}x"],
             ["two reads alone: live - constant", f"{reads_us:.1f} us"]]
    targets = [Target("a step reading size and rank when it runs / the same step with "
                      "constants", step_ratio, 1.02, "x", False,
                      "one ReadVariableOp per value read (a few microseconds)")]
    payload = {"seconds": t, "block_seconds": blocks, "step_ratio": step_ratio, "reads_added_us": reads_us,
               "native_ops": native_ops.load() is not None, "rows": args.rows,
               "width": args.width, "batch": args.batch}
    common.finish(comm, args, "world_values", payload, ["what", "ms"], rows, targets)


if __name__ == "__main__":
    main()
