"""Rank side: the native enqueue op and the traced groups of per-tensor allreduces.

What it hands the runtime is TensorFlow's own memory, read in place by the
background thread, so: a tensor TensorFlow frees after the enqueue stays valid
until the collective is done; results still in use while the next collective
runs keep their values. Per-tensor allreduces traced in one tf.function go out
as one fused batch; ops that must not wait for each other (one reducing the
other's result, a stateful op between them) are not held together, and a step
that fails before all of its group was enqueued does not hang.

Run by tests/test_matrix_tensorflow.py under mpirun -np 1..4; every result is
checked against NumPy from each rank's known input.
"""
import gc
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import pytest
import tensorflow as tf

import horolite as hl
import horolite.tensorflow as hvd
from horolite.tensorflow import native_ops
from mpi4py import MPI
from tf_modes import NATIVE, value

hvd.init()
R, N = hvd.rank(), hvd.size()
pytestmark = pytest.mark.skipif(not NATIVE, reason="HOROLITE_TF_NATIVE_OPS=0 in this run")


def over_ranks(fn):
    return sum(fn(r) for r in range(N))


def _batches():
    """Fused batches, and control rounds that carried small tensors (on one host they
    ride in the round that says every rank has them: execution/carried.py)."""
    rt = hl.api.basics.runtime()
    return rt.executor.fused_batches + (rt.carrier.rounds if rt.carrier is not None else 0)


def test_the_ops_in_a_function_graph_are_native():
    assert native_ops.load() is not None
    fn = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum))
    types = {op.type for op in fn.get_concrete_function(tf.constant(value(R))).graph.get_operations()}
    assert {"HorolitEnqueue", "HorolitAsyncWait"} <= types and not types & {"PyFunc", "EagerPyFunc"}


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64, np.float16,
                                   np.uint8, np.int8])
def test_per_tensor_allreduces_in_a_function_go_out_as_one_batch(dtype):
    count = 40
    xs = [tf.constant(value(R, (5, 7), dtype) + i) for i in range(count)]
    fn = tf.function(lambda ts: [hvd.allreduce(t, op=hvd.Sum) for t in ts])
    fn(xs)  # traced; the response cache knows them after this call
    before = _batches()
    for _ in range(3):
        out = fn(xs)
    for i, o in enumerate(out):
        np.testing.assert_array_equal(o.numpy(), over_ranks(lambda r: value(r, (5, 7), dtype) + i))
    if N > 1:  # (one rank reduces without fusing anything)
        assert _batches() - before == 3, "the 40 per-tensor allreduces did not go out as one batch"


def test_an_allreduce_of_an_allreduce_in_one_function_does_not_wait_for_itself():
    # The second depends on the first's result: not held in one group (that would deadlock).
    x = tf.constant(value(R))

    @tf.function
    def fn(t):
        a = hvd.allreduce(t, op=hvd.Sum)
        b = hvd.allreduce(a * 2.0, op=hvd.Sum)
        c = hvd.allreduce(t + 1.0, op=hvd.Sum)
        return a, b, c
    a, b, c = fn(x)
    total = over_ranks(value)
    np.testing.assert_allclose(a.numpy(), total)
    np.testing.assert_allclose(b.numpy(), 2.0 * N * total)
    np.testing.assert_allclose(c.numpy(), total + N)


def test_a_stateful_op_between_two_allreduces_does_not_hold_the_second():
    # tf.function runs stateful ops in program order: the assign waits for the first result,
    # the second enqueue waits for the assign, so the two must not wait for each other.
    v = tf.Variable(np.zeros((2, 3), np.float32))
    flag = tf.Variable(0.0)

    @tf.function
    def fn(t):
        a = hvd.allreduce(t, op=hvd.Sum)
        tf.print(tf.reduce_sum(a), output_stream="file:///dev/null")
        flag.assign_add(1.0)
        v.assign(a)
        return a, hvd.allreduce(t * 3.0, op=hvd.Sum)
    a, b = fn(tf.constant(value(R)))
    np.testing.assert_allclose(v.numpy(), over_ranks(value))
    np.testing.assert_allclose(b.numpy(), 3.0 * over_ranks(value))


def test_a_step_that_fails_before_its_group_is_enqueued_fails_and_the_next_works():
    # A reshape fails between two members of one group on every rank: the first member's
    # wait is cancelled with the step instead of waiting forever for the second; the next
    # call runs the whole group again.
    spec = tf.TensorSpec(None, tf.float32)

    @tf.function(input_signature=[spec, spec])
    def fn(t, u):
        a = hvd.allreduce(t, op=hvd.Sum)
        b = hvd.allreduce(tf.reshape(u, [-1, 4]), op=hvd.Sum)
        return a, b
    good, quad = tf.constant(value(R)), tf.constant(value(R, (4, 2)))
    fn(good, quad)
    group = fn.get_concrete_function().graph._horolite_group
    assert group.size == 2, "the two allreduces were not one group"
    with pytest.raises(tf.errors.InvalidArgumentError, match="eshape"):
        fn(good, tf.constant(value(R)))  # 6 values: no [-1, 4]
    a, b = fn(good, quad * 2.0)
    np.testing.assert_allclose(a.numpy(), over_ranks(value))
    np.testing.assert_allclose(b.numpy(), 2.0 * over_ranks(lambda r: value(r, (4, 2))).reshape(2, 4))


def test_a_tensor_freed_after_the_enqueue_stays_valid_until_the_collective_is_done():
    # The input exists only inside the function (TensorFlow frees it once its consumers ran);
    # a later rank submits late, so the collective is still running when that happens.
    size = 1 << 16

    @tf.function
    def fn(seed):
        big = tf.fill([size], seed) + tf.range(size, dtype=tf.float32)
        return hvd.allreduce(big, op=hvd.Sum)
    MPI.COMM_WORLD.Barrier()
    if R == N - 1:
        time.sleep(0.2)
    out = fn(tf.constant(float(R)))
    for _ in range(5):  # TensorFlow reuses the freed memory meanwhile
        tf.fill([size], -1.0).numpy()
        gc.collect()
    expect = sum(float(r) for r in range(N)) + N * np.arange(size, dtype=np.float32)
    np.testing.assert_allclose(out.numpy(), expect)


def test_results_in_use_keep_their_values_while_the_next_collectives_run():
    fn = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum, name="reused"))
    kept = [fn(tf.constant(value(R) + k)) for k in range(6)]  # every result held at once
    for k, out in enumerate(kept):
        np.testing.assert_allclose(out.numpy(), over_ranks(lambda r: value(r) + k))


def test_a_graph_error_names_the_tensor_on_every_rank_with_horovods_class():
    if N < 2:
        pytest.skip("a mismatch needs two ranks")
    shape = (2, 3) if R == 0 else (3, 2)
    fn = tf.function(lambda t: hvd.allreduce(t, name="mismatched"))
    with pytest.raises(tf.errors.FailedPreconditionError, match="mismatched"):
        fn(tf.constant(np.ones(shape, np.float32)))
    # and the runtime keeps working
    out = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum))(tf.constant(value(R)))
    np.testing.assert_allclose(out.numpy(), over_ranks(value))
