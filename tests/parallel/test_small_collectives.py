"""Small collectives on one host: carried in the control round, run on the caller's turn.

Runs on every rank under mpirun (tests/test_matrix_core.py, 1-4 ranks and the MPI ring
variant) and across the bed's hosts (tests/multihost). Where the runtime's ranks share
a host and shared memory is on, a repeated small allreduce must be reduced from the
control board's round (execution/carried.py) and a synchronous call must run its
cycles on the calling thread (runtime/turns.py); elsewhere neither applies and the
results must be the same. The driver says which applies (HOROLITE_TEST_EXPECT_BOARD),
so a job that lost its board fails instead of skipping the path checks. What ran is
read from the runtime's counters: tensors carried in control rounds, cycles run on a
caller's thread, cache hits that waited for every rank. Every result is checked
against NumPy from each rank's known inputs.

A cached call waits for the others at most a second before it goes back to
negotiation (runtime/background.py: CACHE_DEMOTE_SECONDS), so on a loaded machine
one of several cached calls may not be carried: the checks ask for one of three.
"""
import os
import threading
import time
import zlib

import ml_dtypes
import numpy as np
import pytest

import horolite as hvd
from horolite.execution.carried import CARRY_READ_BYTES
from horolite.runtime import registry
from horolite.transport.control_board import CARRY_TABLE_BYTES, MAILBOX_BYTES
from horolite.core.mpi_library import MPI  # the job world's: mpi4py's under mpirun

from float16_sums import rounding_sums

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
RT = registry.global_runtime()
BOARD = RT.transport.board is not None  # one host, shared memory on, more than one rank
# The most bytes a control round carries for one tensor: what a rank may read over all
# ranks' copies, and (at 2 ranks) what a mailbox holds after its table.
LIMIT = min(CARRY_READ_BYTES // SIZE, MAILBOX_BYTES - CARRY_TABLE_BYTES)


def carried():
    return RT.carrier.carried if RT.carrier is not None else 0


def test_the_board_is_there_exactly_where_the_driver_expects_it():
    expect = os.environ.get("HOROLITE_TEST_EXPECT_BOARD")
    assert expect in ("0", "1"), "the driver must say whether this job has the control board"
    assert BOARD == (expect == "1")
    assert (RT.carrier is not None) == BOARD


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
    before = carried()
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
        if op == hvd.Average and dtype.startswith(("float", "bfloat")):  # the mean rounds once, to the dtype
            np.testing.assert_allclose(got.astype(np.float64), want, rtol={
                "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 1e-6}.get(dtype, 1e-12))
        else:  # sums, products, min and max of these small integers are exact in every dtype
            np.testing.assert_array_equal(got.astype(np.float64), want)
        assert np.array_equal(inputs[RANK], mine), "the input was modified"
    if BOARD:  # (a cached call late by over a second goes back to negotiation instead)
        assert carried() - before >= 1, "no cached call was carried in a control round"
    else:
        assert carried() == before == 0


def test_scale_factors_round_as_the_negotiated_path_does():
    # float16 with both scale factors: the sum rounds to float16 once, then the postscale
    # applies in float32 (Horovod's order), bit for bit, cached call after cached call
    # (the last two are cache hits; on one host they are carried in the control round).
    inputs, total = rounding_sums((2 * SIZE + 3,), SIZE, 11)
    post = 0.7391
    want = (np.float32(post) * (2 * total).astype(np.float16).astype(np.float32)).astype(np.float16)
    hits, before = RT.hits.waited, carried()
    for _ in range(3):
        got = hvd.allreduce(inputs[RANK], op=hvd.Sum, name="small.f16.scaled",
                            prescale_factor=2.0, postscale_factor=post)
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
    assert RT.hits.waited - hits == 2, "the second and third calls were not cache hits"
    assert (carried() - before >= 1) == BOARD
    # integers: the prescale truncates each input, the postscale the sum
    ints = every_rank((9,), "int32", "scaled")
    want = np.trunc(sum(np.trunc(a * 0.5) for a in ints) * 3.0)
    hits, before = RT.hits.waited, carried()
    for _ in range(3):
        got = hvd.allreduce(ints[RANK], op=hvd.Sum, name="small.i32.scaled",
                            prescale_factor=0.5, postscale_factor=3.0)
        np.testing.assert_array_equal(got, want)
    assert RT.hits.waited - hits == 2, "the second and third calls were not cache hits"
    assert (carried() - before >= 1) == BOARD


def test_small_groups_and_mixed_sizes_in_one_step():
    # A packed group, one element, a tensor at and one far over what a round carries,
    # submitted together in a per-rank order, three steps.
    sizes = [1, 257, LIMIT // 4, 256 * 1024]
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


def test_a_tensor_at_what_a_round_carries_is_carried_and_one_byte_more_is_not():
    for nbytes, carry in ((LIMIT, BOARD), (LIMIT + 1, False)):
        name = f"small.limit.{nbytes}"
        for step in range(4):  # the first call negotiates; the others are cache hits
            inputs = every_rank((nbytes,), "uint8", (name, step))
            if step == 1:
                before = carried()
            got = hvd.allreduce(inputs[RANK], op=hvd.Sum, name=name)
            np.testing.assert_array_equal(got, sum(a.astype(np.int64) for a in inputs))
        assert (carried() - before >= 1) == carry, (nbytes, carried() - before)
        if not carry:
            assert carried() == before


@pytest.mark.skipif(SIZE == 1, reason="needs a late rank")
def test_a_late_rank_waits_in_the_callers_turn():
    # The last rank is held back by an MPI message until each other rank's synchronous call
    # has run a cycle on its calling thread, waiting there in the board's round for the late
    # rank (runtime/turns.py), or for two seconds: a rank whose peers already wait in the
    # round is rung, and its background thread may take the cycles first. So: in one of
    # twelve tries, some rank waited on its caller's turn (the ranks' answers gathered over
    # MPI after each try; the first that sees it ends them). Without a board no caller runs
    # cycles. (Six tries at np 2 under Open MPI on 2 busy cores once saw none: every rank's
    # background thread was mid-cycle each time.)
    comm, late = MPI.COMM_WORLD, SIZE - 1
    want = np.full(4, float(sum(range(SIZE))))
    hvd.allreduce(np.full(4, float(RANK), np.float32), op=hvd.Sum, name="turn.late")  # cached
    seen = []
    for _ in range(12):
        hvd.barrier()
        if RANK == late:
            for peer in range(SIZE - 1):
                assert comm.recv(source=peer, tag=48) == "go"
            got = hvd.allreduce(np.full(4, float(RANK), np.float32), op=hvd.Sum, name="turn.late")
        else:
            before = RT.turns.caller_cycles_run

            def release():
                for _ in range(200 if BOARD else 10):
                    if RT.turns.caller_cycles_run > before:
                        break
                    time.sleep(0.01)
                seen.append(RT.turns.caller_cycles_run > before)  # while the late rank waits
                comm.send("go", dest=late, tag=48)
            releaser = threading.Thread(target=release)
            releaser.start()
            got = hvd.allreduce(np.full(4, float(RANK), np.float32), op=hvd.Sum, name="turn.late")
            releaser.join()
        np.testing.assert_array_equal(got, want)
        if comm.allreduce(bool(seen and seen[-1]), op=MPI.LOR):
            break
    everyone = comm.allgather(seen)
    assert any(any(s) for s in everyone) == BOARD, everyone


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
    # On one host the first ranks to call run the cycle on their own thread; a rank whose
    # peers already wait in the round is rung, and its background thread may take that
    # cycle first. So: in one of three tries, some rank ran it on its caller's turn (the
    # ranks' counts gathered over MPI).
    hvd.allreduce(np.zeros(3, np.float32), name="small.mismatch")
    on_turn = []
    for _ in range(3):
        if SIZE > 1:
            before = RT.turns.caller_cycles_run
            with pytest.raises(hvd.TensorMismatchError, match="small.mismatch"):
                hvd.allreduce(np.zeros(3 + (RANK == SIZE - 1), np.float32), name="small.mismatch")
            on_turn.append(sum(MPI.COMM_WORLD.allgather(RT.turns.caller_cycles_run - before)))
        np.testing.assert_array_equal(hvd.allreduce(np.ones(3, np.float32), op=hvd.Sum,
                                                    name="small.after"), np.full(3, float(SIZE)))
    assert any(on_turn) == BOARD, on_turn
