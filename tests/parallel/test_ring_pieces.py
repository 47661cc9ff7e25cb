"""The pipelined ring (horolite/transport/ring.py) with tiny pieces and a tiny window.

Runs on every rank under mpirun (tests/test_matrix_core.py). With PIECE_BYTES
cut to a few dozen bytes, every step travels as many pieces, the scratch
window fills and drains many times, and allgather pieces are received into
regions whose scatter-reduce sends must finish first: the paths a 64 MiB
buffer takes, on small buffers. The hierarchical collectives the same way, where
the (real or pretend) host layout allows them. Results are compared with NumPy.
"""
import numpy as np
import pytest
from horolite.core.mpi_library import MPI  # the job world's: mpi4py's under mpirun

from horolite.transport import ring as ring_module
from horolite.core.ops import ReduceOp
from horolite.transport.ring import Ring, even_bounds
from horolite.transport.mpi import PointToPoint, Waiter
from pretend_hosts import expected_topology, hierarchical_applies

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


def check_allgather_uneven(transport, lengths):
    """Every rank's block, of its own length (0 included), ends up everywhere in order."""
    sizes = [lengths[q % len(lengths)] + q for q in range(SIZE)]
    bounds = np.concatenate(([0], np.cumsum(sizes))).tolist()
    parts = [np.random.default_rng(q).integers(0, 255, sizes[q]).astype(np.uint8)
             for q in range(SIZE)]
    buf = np.zeros(bounds[-1], dtype=np.uint8)
    buf[bounds[RANK]:bounds[RANK + 1]] = parts[RANK]
    transport.allgather(buf, bounds)
    assert np.array_equal(buf, np.concatenate(parts))


@pytest.mark.parametrize("lengths", [[0], [1], [7], [100, 0, 3, 250]], ids=str)
def test_allgather_uneven(ring, lengths):
    check_allgather_uneven(ring, lengths)


@pytest.fixture(scope="module", params=[(24, 40, 1), (64, 1000, 2), (1 << 20, 4 << 20, 3)],
                ids=str)
def hierarchical(request):
    """The pipelined hierarchical collectives with tiny pieces and chunks, or None where the
    layout does not allow them (one host, one rank per host, hosts of different sizes)."""
    from horolite.transport import hierarchical as hier_module
    piece, chunk, in_flight = request.param
    saved = (ring_module.PIECE_BYTES, hier_module.CHUNK_BYTES, hier_module.IN_FLIGHT)
    ring_module.PIECE_BYTES, hier_module.CHUNK_BYTES, hier_module.IN_FLIGHT = piece, chunk, in_flight
    comm = COMM.Dup()
    hier, gather = hier_module.open_hierarchical(comm, Waiter(polite=True), True, True)
    assert hier is gather
    yield hier
    if hier is not None:
        hier.close()
    comm.Free()
    ring_module.PIECE_BYTES, hier_module.CHUNK_BYTES, hier_module.IN_FLIGHT = saved


def test_hierarchical_serves_exactly_where_the_layout_allows(hierarchical):
    # The layout comes from each rank's host (or HOROLITE_TEST_HOST_IDENTITY's pretend
    # hosts, which tests/test_matrix_core.py sweeps): hosts of equal size > 1, several hosts.
    assert (hierarchical is not None) == hierarchical_applies(), expected_topology(RANK)["hosts"]
    if hierarchical is not None:
        topo = expected_topology(RANK)
        assert (hierarchical.local_rank, hierarchical.local_size) == (topo["local_rank"],
                                                                      topo["local_size"])
        assert (hierarchical.cross_rank, hierarchical.cross_size) == (topo["cross_rank"],
                                                                      topo["cross_size"])


# The hierarchical cases exist where the layout allows the path (test_matrix_core.py runs
# this file on pretend hosts of 2+2 ranks, tests/multihost on 2x2 and 3x2 real ones).
if hierarchical_applies():
    @pytest.mark.parametrize("dtype", ["float32", "int32"])
    @pytest.mark.parametrize("op", sorted(REFERENCE))
    @pytest.mark.parametrize("count", SIZES + ["big"])
    def test_hierarchical_allreduce(hierarchical, count, dtype, op):
        from horolite.transport import hierarchical as hier_module
        if count == "big":  # thousands of chunks either way; the 40-byte ones cost the most
            count = 30011 if hier_module.CHUNK_BYTES >= 1000 else 3001
        expect = REFERENCE[op](np.stack([inputs(count, dtype, q) for q in range(SIZE)]), axis=0)
        buf = inputs(count, dtype, RANK)
        hierarchical.allreduce(buf, op, 1.0)
        assert np.array_equal(buf, expect.astype(dtype))
        src, out = inputs(count, dtype, RANK), np.zeros(count, dtype=dtype)
        hierarchical.allreduce_from(src, out, op, 0.5 if dtype == "float32" else 1.0)
        assert np.array_equal(out, (expect * (0.5 if dtype == "float32" else 1)).astype(dtype))

    @pytest.mark.parametrize("lengths", [[0], [1], [7], [100, 0, 3, 250]], ids=str)
    def test_hierarchical_allgather_uneven(hierarchical, lengths):
        check_allgather_uneven(hierarchical, lengths)
