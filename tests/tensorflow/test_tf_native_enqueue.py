"""Rank side: the native enqueue op and the traced groups of per-tensor allreduces.

What it hands the runtime is TensorFlow's own memory, read in place by the
background thread, so: a tensor TensorFlow frees after the enqueue stays valid
until the collective is done, even while TensorFlow hands that memory out again
(a rank is held back by an MPI message so the collective stays open meanwhile);
results still in use while the next collective runs keep their values.
Per-tensor allreduces traced in one tf.function go out as one fused batch of
all of them; ops that must not wait for each other (one reducing the other's
result, a stateful op between them) are not held together, and a step that
fails before all of its group was enqueued does not hang: its held member is
dropped when the next run starts.

What the runtime did is read from its own counters: the intake's members held
for a later member and dropped (tensorflow/intake.py), the executor's fused
batches and their tensors, the control rounds that carried tensors and how many
(execution/carried.py), the tensors in flight in the runtime's queue.

Run by tests/test_matrix_tensorflow.py under mpirun -np 1..4; every result is
checked against NumPy from each rank's known input.
"""
import gc
import os
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import pytest
import tensorflow as tf

import horolite as hl
import horolite.tensorflow as hvd
from horolite.tensorflow import native_ops
from horolite.tensorflow.intake import intake_for
from horolite.core.mpi_library import MPI  # the job world's: mpi4py's under mpirun
from tf_modes import NATIVE, value

hvd.init()
R, N = hvd.rank(), hvd.size()
pytestmark = pytest.mark.skipif(not NATIVE, reason="HOROLITE_TF_NATIVE_OPS=0 in this run")


def over_ranks(fn):
    return sum(fn(r) for r in range(N))


def _batches():
    """(batches, tensors in them): fused batches of the executor, and control rounds that
    carried small tensors (on one host they ride in the round that says every rank has
    them: execution/carried.py)."""
    rt = hl.api.basics.runtime()
    carrier = rt.carrier
    return (rt.executor.fused_batches + (carrier.rounds if carrier is not None else 0),
            rt.executor.fused_tensors + (carrier.carried if carrier is not None else 0))


def _intake():
    """The background thread's side of the enqueue ops: its held/dropped counts."""
    return intake_for(native_ops.load())


def _held_dropped():
    intake = _intake()
    return intake.held, intake.dropped


def test_the_ops_in_a_function_graph_are_native():
    assert native_ops.load() is not None
    fn = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum))
    types = {op.type for op in fn.get_concrete_function(tf.constant(value(R))).graph.get_operations()}
    assert {"HorolitEnqueue", "HorolitAsyncWait"} <= types and not types & {"PyFunc", "EagerPyFunc"}


def group_input(r, i, shape, dtype):
    """Rank r's input for member i: values 0-29, so a sum over 4 ranks stays within
    int8 (no wrap-around for NumPy and horolite to agree on)."""
    return ((np.arange(int(np.prod(shape))).reshape(shape) + 3 * r + i) % 30).astype(dtype)


@pytest.mark.parametrize("dtype,shape", [(d, (5, 7)) for d in (
    np.float32, np.float64, np.int32, np.int64, np.float16, np.uint8, np.int8)]
    + [(np.float32, (130, 130))], ids=lambda p: np.dtype(p).name if not isinstance(p, tuple)
    else "x".join(map(str, p)))
def test_per_tensor_allreduces_in_a_function_go_out_as_one_batch(dtype, shape):
    # 5x7: small enough to ride in the control round on one host (all 40 in one round);
    # 130x130 float32 (66 KB): more than a round carries at np 2-4, one fused batch.
    count, calls = 40, 3
    xs = [tf.constant(group_input(R, i, shape, dtype)) for i in range(count)]
    fn = tf.function(lambda ts: [hvd.allreduce(t, op=hvd.Sum) for t in ts])
    fn(xs)  # traced; the response cache knows them after this call
    batches, tensors = _batches()
    fused = hl.api.basics.runtime().executor.fused_tensors
    held, _ = _held_dropped()
    for _ in range(calls):
        out = fn(xs)
    for i, o in enumerate(out):
        want = over_ranks(lambda r: group_input(r, i, shape, np.int64))
        assert want.max() <= np.iinfo(np.int8).max  # (exact in every dtype of the test)
        np.testing.assert_array_equal(o.numpy(), want.astype(dtype))
    # The background thread held the first 39 members of each call for the 40th.
    assert _held_dropped()[0] - held == calls * (count - 1)
    if N > 1:  # (one rank reduces without fusing anything)
        got = _batches()
        assert (got[0] - batches, got[1] - tensors) == (calls, calls * count), \
            "the 40 per-tensor allreduces of a call did not go out as one batch of 40"
        if shape == (130, 130):  # (not carried: the executor fused them)
            assert hl.api.basics.runtime().executor.fused_tensors - fused == calls * count


def test_an_allreduce_of_an_allreduce_in_one_function_does_not_wait_for_itself():
    # The second depends on the first's result: not held in one group (that would deadlock);
    # the third may join the second's group: the runtime holds the second for it.
    x = tf.constant(value(R))

    @tf.function
    def fn(t):
        a = hvd.allreduce(t, op=hvd.Sum)
        b = hvd.allreduce(a * 2.0, op=hvd.Sum)
        c = hvd.allreduce(t + 1.0, op=hvd.Sum)
        return a, b, c
    for _ in range(2):
        held, dropped = _held_dropped()
        a, b, c = fn(x)
        assert _held_dropped() == (held + 1, dropped), "groups other than {a}, {b, c}"
    total = over_ranks(value)
    np.testing.assert_allclose(a.numpy(), total)
    np.testing.assert_allclose(b.numpy(), 2.0 * N * total)
    np.testing.assert_allclose(c.numpy(), total + N)


def test_a_stateful_op_between_two_allreduces_does_not_hold_the_second():
    # tf.function runs stateful ops in program order: the assign waits for the first result,
    # the second enqueue waits for the assign, so the two must not wait for each other. The
    # third joins the second's group: the runtime holds the second for it, never the first.
    v = tf.Variable(np.zeros((2, 3), np.float32))
    flag = tf.Variable(0.0)

    @tf.function
    def fn(t):
        a = hvd.allreduce(t, op=hvd.Sum)
        tf.print(tf.reduce_sum(a), output_stream="file:///dev/null")
        flag.assign_add(1.0)
        v.assign(a)
        return a, hvd.allreduce(t * 3.0, op=hvd.Sum), hvd.allreduce(t - 1.0, op=hvd.Sum)
    for _ in range(2):
        held, dropped = _held_dropped()
        a, b, c = fn(tf.constant(value(R)))
        assert _held_dropped() == (held + 1, dropped), "groups other than {a}, {b, c}"
    np.testing.assert_allclose(v.numpy(), over_ranks(value))
    np.testing.assert_allclose(b.numpy(), 3.0 * over_ranks(value))
    np.testing.assert_allclose(c.numpy(), over_ranks(value) - N)


def test_a_step_that_fails_before_its_group_is_enqueued_fails_and_the_next_works():
    # A reshape fails between two members of one group on every rank. Where the first
    # member's enqueue ran before the failure (TensorFlow does not order the two), the
    # runtime held it for the second, which never comes: its wait is cancelled with the
    # step instead of waiting forever, and the next run drops it as stale and runs the
    # whole group again.
    spec = tf.TensorSpec(None, tf.float32)

    @tf.function(input_signature=[spec, spec])
    def fn(t, u):
        a = hvd.allreduce(t, op=hvd.Sum)
        b = hvd.allreduce(tf.reshape(u, [-1, 4]), op=hvd.Sum)
        return a, b
    good, quad = tf.constant(value(R)), tf.constant(value(R, (4, 2)))
    held, dropped = _held_dropped()
    fn(good, quad)
    assert _held_dropped() == (held + 1, dropped), "the two allreduces were not one group"
    stale = 0
    for k in range(3):
        held, dropped = _held_dropped()
        with pytest.raises(tf.errors.InvalidArgumentError, match="eshape"):
            fn(good, tf.constant(value(R)))  # 6 values: no [-1, 4]
        a, b = fn(good, quad * (k + 2.0))
        now = _held_dropped()
        # this run's first member held (1), plus the failed run's if it was enqueued:
        # exactly that one is dropped
        assert now[1] - dropped == now[0] - held - 1 in (0, 1), (held, dropped, now)
        stale += now[1] - dropped
        np.testing.assert_allclose(a.numpy(), over_ranks(value))
        np.testing.assert_allclose(b.numpy(), (k + 2.0) * over_ranks(
            lambda r: value(r, (4, 2))).reshape(2, 4))
    assert stale > 0, "no failed step left a member held: the cancelled wait never ran"


def test_a_tensor_freed_after_the_enqueue_stays_valid_until_the_collective_is_done():
    # The input exists only inside the function (TensorFlow frees it once its consumers ran,
    # the enqueue op being the only one). The last rank is held back by an MPI message until
    # the others' collective is in flight in their runtime and they have had TensorFlow hand
    # out and fill same-size buffers with -1: the freed input's memory among them, unless
    # the enqueue op keeps it alive. The result must still be the inputs' sum.
    size = 1 << 16
    comm, late = MPI.COMM_WORLD, N - 1

    @tf.function
    def fn(seed):
        big = tf.fill([size], seed) + tf.range(size, dtype=tf.float32)
        return hvd.allreduce(big, op=hvd.Sum, name="freed.input")
    expect = sum(float(r) for r in range(N)) + N * np.arange(size, dtype=np.float32)
    np.testing.assert_allclose(fn(tf.constant(float(R))).numpy(), expect)  # traced, cached
    queue = hl.api.basics.runtime().queue
    if R == late:
        for peer in range(N - 1):
            assert comm.recv(source=peer, tag=47) == "churned"
        out = fn(tf.constant(float(R)))
    else:
        result, errors = [], []

        def call():
            try:
                result.append(fn(tf.constant(float(R))))
            except BaseException as e:  # noqa: BLE001 - raised below
                errors.append(e)
        caller = threading.Thread(target=call)
        caller.start()
        for _ in range(6000):  # until the runtime has it in flight (up to 60 s)
            if queue.has_inflight() or errors:
                break
            time.sleep(0.01)
        assert queue.has_inflight(), "the enqueued allreduce never reached the runtime"
        gc.collect()
        kept = []
        for _ in range(32):  # TensorFlow hands out buffers of the freed input's size again
            kept.append(tf.fill([size], -1.0) + 0.0)
            kept.append(tf.fill([size], -1.0).numpy())
        still_open = queue.has_inflight()
        comm.send("churned", dest=late, tag=47)
        caller.join(120)
        assert not caller.is_alive() and not errors, errors
        assert still_open, "the collective was done before the late rank came"
        out = result[0]
        assert all((np.asarray(k) == -1.0).all() for k in kept)
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
