"""The pipelined ring (horolite/transport/ring.py) with tiny pieces and a tiny window.

Runs on every rank under mpirun (tests/test_matrix_core.py). With PIECE_BYTES
cut to a few dozen bytes, every step travels as many pieces, the scratch
window fills and drains many times, and allgather pieces are received into
regions whose scatter-reduce sends must finish first: the paths a 64 MiB
buffer takes, on small buffers. Results are compared with NumPy.
"""
import numpy as np
import pytest
from mpi4py import MPI

from horolite.transport import ring as ring_module
from horolite.core.ops import ReduceOp
from horolite.transport.ring import Ring, even_bounds
from horolite.transport.mpi import PointToPoint, Waiter

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
SIZES = [0, 1, SIZE, 37, 1000, 4099]
REFERENCE = {ReduceOp.SUM: np.sum, ReduceOp.MIN: np.min, ReduceOp.MAX: np.max,
             ReduceOp.PRODUCT: np.prod}


@pytest.fixture(scope="module", params=[(24, 1), (64, 3), (1 << 20, 8)], ids=str)
def ring(request):
    piece, window = request.param
    saved = ring_module.PIECE_BYTES, ring_module.WINDOW
    ring_module.PIECE_BYTES, ring_module.WINDOW = piece, window
    comm = COMM.Dup()
    yield Ring(PointToPoint(comm, Waiter(polite=True)))
    comm.Free()
    ring_module.PIECE_BYTES, ring_module.WINDOW = saved


def inputs(count, dtype, rank):
    rng = np.random.default_rng(1000 * rank + count)
    return rng.integers(1, 4, size=count).astype(dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "uint8"])
@pytest.mark.parametrize("op", sorted(REFERENCE))
@pytest.mark.parametrize("count", SIZES)
@pytest.mark.parametrize("in_place", [True, False])
def test_allreduce(ring, count, dtype, op, in_place):
    expect = REFERENCE[op](np.stack([inputs(count, dtype, q) for q in range(SIZE)]), axis=0)
    src = inputs(count, dtype, RANK)
    if in_place:
        ring.allreduce(src, op)
        out = src
    else:
        out = np.full(count, 99, dtype=dtype)
        ring.allreduce_from(src, out, op)
        assert np.array_equal(src, inputs(count, dtype, RANK)), "the input was written"
    assert np.array_equal(out, expect.astype(dtype))


@pytest.mark.parametrize("count", SIZES)
def test_allreduce_postscale(ring, count):
    expect = np.sum([inputs(count, "float64", q) for q in range(SIZE)], axis=0) * 0.5
    buf = inputs(count, "float64", RANK)
    ring.allreduce(buf, ReduceOp.SUM, 0.5)
    assert np.array_equal(buf, expect)


@pytest.mark.parametrize("rows", [1, 5, 33, 301])
def test_scatter_reduce_uneven(ring, rows):
    count = rows * 3
    bounds = [b * 3 for b in even_bounds(rows, SIZE)]
    buf = inputs(count, "float32", RANK)
    ring.scatter_reduce(buf, bounds, ReduceOp.SUM, 0.25)
    expect = np.sum([inputs(count, "float32", q) for q in range(SIZE)], axis=0) * 0.25
    lo, hi = bounds[RANK], bounds[RANK + 1]
    assert np.array_equal(buf[lo:hi], expect[lo:hi].astype(np.float32))


@pytest.mark.parametrize("lengths", [[0], [1], [7], [100, 0, 3, 250]], ids=str)
def test_allgather_uneven(ring, lengths):
    sizes = [lengths[q % len(lengths)] + q for q in range(SIZE)]
    bounds = np.concatenate(([0], np.cumsum(sizes))).tolist()
    parts = [np.random.default_rng(q).integers(0, 255, sizes[q]).astype(np.uint8)
             for q in range(SIZE)]
    buf = np.zeros(bounds[-1], dtype=np.uint8)
    buf[bounds[RANK]:bounds[RANK + 1]] = parts[RANK]
    ring.allgather(buf, bounds)
    assert np.array_equal(buf, np.concatenate(parts))


@pytest.fixture(scope="module", params=[(24, 40, 1), (64, 1000, 2), (1 << 20, 4 << 20, 3)],
                ids=str)
def hierarchical(request):
    """The pipelined hierarchical allreduce with tiny pieces and chunks (on one host, or one
    rank per host, it does not apply: those tests skip)."""
    from horolite.transport import hierarchical as hier_module
    piece, chunk, in_flight = request.param
    saved = (ring_module.PIECE_BYTES, hier_module.CHUNK_BYTES, hier_module.IN_FLIGHT)
    ring_module.PIECE_BYTES, hier_module.CHUNK_BYTES, hier_module.IN_FLIGHT = piece, chunk, in_flight
    comm = COMM.Dup()
    hier, _ = hier_module.open_hierarchical(comm, Waiter(polite=True), True, False)
    yield hier
    if hier is not None:
        hier.close()
    comm.Free()
    ring_module.PIECE_BYTES, hier_module.CHUNK_BYTES, hier_module.IN_FLIGHT = saved


@pytest.mark.parametrize("dtype", ["float32", "int32"])
@pytest.mark.parametrize("op", sorted(REFERENCE))
@pytest.mark.parametrize("count", SIZES + [30011])
def test_hierarchical_allreduce(hierarchical, count, dtype, op):
    if hierarchical is None:
        pytest.skip("the hierarchical path needs several hosts of several ranks each")
    expect = REFERENCE[op](np.stack([inputs(count, dtype, q) for q in range(SIZE)]), axis=0)
    buf = inputs(count, dtype, RANK)
    hierarchical.allreduce(buf, op, 1.0)
    assert np.array_equal(buf, expect.astype(dtype))
    src, out = inputs(count, dtype, RANK), np.zeros(count, dtype=dtype)
    hierarchical.allreduce_from(src, out, op, 0.5 if dtype == "float32" else 1.0)
    assert np.array_equal(out, (expect * (0.5 if dtype == "float32" else 1)).astype(dtype))
