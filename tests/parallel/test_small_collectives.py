"""Small collectives on one host: carried in the control round, run on the caller's turn.

Runs on every rank under mpirun (tests/test_matrix_core.py, 1-4 ranks and the MPI ring
variant) and across the bed's hosts (tests/multihost). Where the runtime's ranks share
a host and shared memory is on, a repeated small allreduce must be reduced from the
control board's round (execution/carried.py) and a synchronous call must run its
cycles on the calling thread (runtime/turns.py); elsewhere neither applies and the
results must be the same. Every result is checked against NumPy from each rank's
known inputs.
"""
import threading
import time
import zlib

import ml_dtypes
import numpy as np
import pytest

import horolite as hvd
from horolite.runtime import registry

from float16_sums import rounding_sums

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
RT = registry.global_runtime()
BOARD = RT.transport.board is not None  # one host, shared memory on, more than one rank


def make(rank, shape, dtype, key, high=5):
    rng = np.random.RandomState(zlib.crc32(repr((rank, key)).encode()))
    return rng.randint(0, high, size=shape).astype(np.dtype(dtype))


def every_rank(shape, dtype, key, high=5):
    return [make(r, shape, dtype, key, high) for r in range(SIZE)]


def reference(op, arrays):
    stack = np.stack([a.astype(np.float64) for a in arrays])
    return {hvd.Sum: stack.sum(0), hvd.Average: stack.mean(0), hvd.Min: stack.min(0),
            hvd.Max: stack.max(0), hvd.Product: stack.prod(0)}[op]


@pytest.mark.parametrize("dtype", ["uint8", "int32", "int64", "float16", "bfloat16",
                                   "float32", "float64"])
@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product],
                         ids=lambda o: o.name)
def test_repeated_small_allreduce_is_carried_and_exact(dtype, op):
    # The first call negotiates the name; the later ones find it cached, and on one host
    # every rank's bytes ride in the control round that says all have it ready.
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    before = RT.carrier.carried if RT.carrier is not None else 0
    for step in range(4):
        # (products stay within 2**4, so uint8 does not wrap)
        inputs = [a.astype(np_dtype) for a in every_rank((3, 7), "int64", (dtype, op.name, step),
                                                          high=3 if op == hvd.Product else 5)]
        mine = inputs[RANK].copy()
        got = hvd.allreduce(inputs[RANK], op=op, name=f"small.{dtype}.{op.name}")
        assert got.dtype == np_dtype and got.shape == (3, 7)
        want = reference(op, inputs)
        if np_dtype.kind in "iu" and op == hvd.Average:
            want = np.trunc(want)  # an integer average truncates, as Horovod's does
        np.testing.assert_allclose(got.astype(np.float64), want,
                                   rtol={"float16": 1e-2, "bfloat16": 1e-2, "float32": 1e-6}.get(dtype, 1e-12))
        assert np.array_equal(inputs[RANK], mine), "the input was modified"
    if BOARD:
        assert RT.carrier.carried - before >= 3


def test_scale_factors_round_as_the_negotiated_path_does():
    # float16 with both scale factors: the sum rounds to float16 once, then the postscale
    # applies in float32 (Horovod's order), bit for bit, cached call after cached call.
    inputs, total = rounding_sums((2 * SIZE + 3,), SIZE, 11)
    post = 0.7391
    want = (np.float32(post) * (2 * total).astype(np.float16).astype(np.float32)).astype(np.float16)
    for _ in range(3):
        got = hvd.allreduce(inputs[RANK], op=hvd.Sum, name="small.f16.scaled",
                            prescale_factor=2.0, postscale_factor=post)
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
    # integers: the prescale truncates each input, the postscale the sum
    ints = every_rank((9,), "int32", "scaled")
    want = np.trunc(sum(np.trunc(a * 0.5) for a in ints) * 3.0)
    for _ in range(3):
        got = hvd.allreduce(ints[RANK], op=hvd.Sum, name="small.i32.scaled",
                            prescale_factor=0.5, postscale_factor=3.0)
        np.testing.assert_array_equal(got, want)


def test_small_groups_and_mixed_sizes_in_one_step():
    # A packed group, one element, a tensor just under and one far over what a round
    # carries, submitted together in a per-rank order, three steps.
    sizes = [1, 257, 16 * 1024 // SIZE, 256 * 1024]
    for step in range(3):
        order = list(range(len(sizes)))
        np.random.RandomState(RANK + 7 * step).shuffle(order)
        handles = {i: hvd.allreduce_async(make(RANK, (sizes[i],), "float32", (i, step)),
                                          op=hvd.Sum, name=f"mixed.{i}") for i in order}
        group = hvd.grouped_allreduce([make(RANK, (n,), "float64", ("g", n, step)) for n in (3, 5, 1)],
                                      op=hvd.Average, name="mixed.group")
        for i, h in handles.items():
            np.testing.assert_array_equal(hvd.synchronize(h),
                                          sum(every_rank((sizes[i],), "float32", (i, step))))
        for n, g in zip((3, 5, 1), group):
            np.testing.assert_allclose(g, sum(every_rank((n,), "float64", ("g", n, step))) / SIZE)


def test_a_late_rank_waits_in_the_callers_turn():
    # The others sit in the board's round on their own threads until the last rank comes.
    before = RT.turns.caller_cycles_run
    for late_ms in (0,) * 10 + (5, 50):
        hvd.barrier()
        if RANK == SIZE - 1:
            time.sleep(late_ms / 1e3)
        got = hvd.allreduce(np.full(4, float(RANK), np.float32), op=hvd.Sum, name="turn.late")
        np.testing.assert_array_equal(got, np.full(4, float(sum(range(SIZE)))))
    if BOARD:
        assert RT.turns.caller_cycles_run > before


def test_a_waiting_caller_and_async_work_from_another_thread():
    # One thread runs synchronous calls (which take the cycles' turn) while another keeps
    # asynchronous ones in flight (which the background thread, or the turn's holder, runs).
    errors = []

    def background_work():
        try:
            for step in range(30):
                hs = [hvd.allreduce_async(np.full(5, float(RANK + i + step)), op=hvd.Sum,
                                          name=f"thread.{i}") for i in range(3)]
                for i, h in enumerate(hs):
                    np.testing.assert_array_equal(
                        hvd.synchronize(h), np.full(5, float(sum(r + i + step for r in range(SIZE)))))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    other = threading.Thread(target=background_work)
    other.start()
    for step in range(30):
        got = hvd.allreduce(np.full(2, float(RANK * step)), op=hvd.Sum, name="main.sync")
        np.testing.assert_array_equal(got, np.full(2, float(sum(r * step for r in range(SIZE)))))
    other.join(60)
    assert not other.is_alive() and not errors, errors


def test_a_mismatch_on_the_callers_turn_fails_everywhere_then_it_works():
    # (a name first seen with a good shape, so the bad one meets the cache's entry)
    hvd.allreduce(np.zeros(3, np.float32), name="small.mismatch")
    if SIZE > 1:
        with pytest.raises(hvd.TensorMismatchError, match="small.mismatch"):
            hvd.allreduce(np.zeros(3 + (RANK == SIZE - 1), np.float32), name="small.mismatch")
    for _ in range(3):
        np.testing.assert_array_equal(hvd.allreduce(np.ones(3, np.float32), op=hvd.Sum,
                                                    name="small.after"), np.full(3, float(SIZE)))
