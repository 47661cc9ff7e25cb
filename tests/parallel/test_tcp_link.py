"""horolite's own TCP connections (transport/tcp.py, transport/tcp_link.py), rank side.

Runs on every rank under mpirun (tests/test_matrix_core.py), at 2, 3 and 4 ranks on
pretend hosts (over loopback). The ring over the TCP link with tiny pieces and a tiny
window (every dtype and op, uneven and zero sizes, reducescatter, allgather) against
NumPy; messages that arrive before their receive, per-tag order over several
streams; a slow reader that fills the socket buffers; a wait that sleeps in the
kernel (counted in context switches, not time); the control exchange over the ring
(OR, gather, broadcast) and its waits; a peer that closes; set-up errors
(an interface that does not exist, a taken port range, an address that refuses).
"""
import re
import socket
import threading
import time

import numpy as np
import pytest
from horolite.core.mpi_library import MPI  # the job world's: mpi4py's under mpirun

from horolite.core.ops import REDUCIBLE_DTYPES, ReduceOp, dtype_from_name
from horolite.failure.links import LinkLost
from horolite.transport import ring as ring_module
from horolite.transport import tcp
from horolite.transport.ring import Ring, even_bounds
from horolite.transport.tcp_control import TcpControl, partners
from horolite.transport.tcp_link import TcpLink
from pretend_hosts import layout

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
HOSTS = layout()
SIZES = [0, 1, SIZE, 37, 1000, 4099]
REFERENCE = {ReduceOp.SUM: np.sum, ReduceOp.MIN: np.min, ReduceOp.MAX: np.max,
             ReduceOp.PRODUCT: np.prod}

pytestmark = pytest.mark.skipif(SIZE < 2, reason="the TCP link needs 2 or more ranks")


def where(q):
    return f"rank {q} (host {HOSTS[q]})"


class Watch:
    """Stands for the transport's waiter: counts the collective watch's calls."""

    def __init__(self):
        self.calls = 0

    def watch(self, waited, peer):
        self.calls += 1


def neighbours(size=SIZE, rank=RANK):
    return sorted({(rank + 1) % size, (rank - 1) % size} - {rank})


def open_mesh(comm=COMM, **kw):
    return tcp.open_mesh(comm, neighbours(), HOSTS, where, **kw)


@pytest.fixture(scope="module", params=[(1, 24, 1), (3, 64, 3), (2, 1 << 20, 8)], ids=str)
def ring(request):
    streams, piece, window = request.param
    saved = ring_module.PIECE_BYTES, ring_module.WINDOW
    ring_module.PIECE_BYTES, ring_module.WINDOW = piece, window
    mesh = open_mesh(streams=streams)
    yield Ring(TcpLink(mesh, 1, range(SIZE), Watch()))
    COMM.Barrier()
    mesh.close()
    ring_module.PIECE_BYTES, ring_module.WINDOW = saved


def inputs(count, dtype, rank):
    rng = np.random.default_rng(1000 * rank + count)
    return rng.integers(1, 4, size=count).astype(dtype_from_name(dtype))


@pytest.mark.parametrize("dtype", sorted(REDUCIBLE_DTYPES))
@pytest.mark.parametrize("op", sorted(REFERENCE))
@pytest.mark.parametrize("count", SIZES)
def test_allreduce_every_dtype_and_op(ring, count, dtype, op):
    stack = np.stack([inputs(count, dtype, q) for q in range(SIZE)]).astype(np.float64)
    expect = REFERENCE[op](stack, axis=0)
    src = inputs(count, dtype, RANK)
    out = np.full(count, 9, dtype=src.dtype)
    ring.allreduce_from(src, out, op)
    assert np.array_equal(out.astype(np.float64), expect.astype(src.dtype).astype(np.float64))
    assert np.array_equal(src, inputs(count, dtype, RANK)), "the input was written"


@pytest.mark.parametrize("count", SIZES)
def test_allreduce_in_place_postscale(ring, count):
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


@pytest.fixture
def mesh2():
    """Two streams to each neighbour, and to each control partner (2**k away)."""
    wanted = sorted(set(neighbours()) | partners(RANK, SIZE))
    mesh = tcp.open_mesh(COMM, wanted, HOSTS, where, streams=2)
    yield mesh
    COMM.Barrier()
    mesh.close()


def test_messages_before_their_receives_and_per_tag_order(mesh2):
    """Rank r sends its right neighbour 5 messages on tag 1 and 3 on tag 2 (over two
    streams); the neighbour posts tag 2 first, after they all arrived, then tag 1."""
    link = TcpLink(mesh2, 4, range(SIZE), Watch())
    sends = [link.isend(np.full(10 + i, 10 * RANK + i, np.int32), tag=1) for i in range(5)]
    sends += [link.isend(np.full(3, 100 + i, np.int64), tag=2) for i in range(3)]
    link.wait_all(sends)
    COMM.Barrier()
    left = (RANK - 1) % SIZE
    got2 = [np.empty(3, np.int64) for _ in range(3)]
    link.wait_all([link.irecv(b, tag=2) for b in got2])
    got1 = [np.empty(10 + i, np.int32) for i in range(5)]
    link.wait_all([link.irecv(b, tag=1) for b in got1])
    assert [int(b[0]) for b in got2] == [100, 101, 102]
    assert [(b.size, int(b[0])) for b in got1] == [(10 + i, 10 * left + i) for i in range(5)]


def test_a_wait_sleeps_in_the_kernel(mesh2):
    """Waiting a second for a late message: the waiting thread switches out a handful of
    times (one per WATCH_EVERY), not thousands (a polling loop)."""
    watch = Watch()
    link = TcpLink(mesh2, 5, range(SIZE), watch)
    COMM.Barrier()
    found = None
    if RANK == 0:
        buf = np.empty(1000, np.float32)
        req = link.irecv(buf, tag=3)
        switches, cpu = _voluntary_switches(), time.thread_time()
        link.wait(req)
        found = (_voluntary_switches() - switches, time.thread_time() - cpu, np.all(buf == 7))
    elif RANK == SIZE - 1:
        time.sleep(1.0)
        link.wait(link.isend(np.full(1000, 7, np.float32), tag=3))
    COMM.Barrier()  # (before any assertion: a failing rank leaves no other in a collective)
    if found is not None:
        switches, cpu, arrived = found
        assert arrived
        assert switches < 60, f"{switches} context switches in a 1 s wait: a polling loop?"
        assert watch.calls >= 3, "the collective watch was not called while waiting"
        assert cpu < 0.25, f"{cpu:.3f} s of CPU in a 1 s wait"


def _voluntary_switches():
    with open(f"/proc/self/task/{threading.get_native_id()}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt"))


@pytest.mark.parametrize("shape", ["tree", "ring"])
@pytest.mark.parametrize("members", ["every rank", "first and last"])
def test_the_control_exchange(mesh2, members, shape):
    """The control exchange (tcp_control.py), in log2(n) steps and around the ring: OR,
    gather at the first participant and broadcast from it, against NumPy, with empty and
    uneven payloads; among every rank, and among two of them (as hosts' leaders are)."""
    ranks = list(range(SIZE)) if members == "every rank" else [0, SIZE - 1]
    link_id = 10 if members == "every rank" else 11
    control = (TcpControl(TcpLink(mesh2, link_id, ranks, Watch()), shape) if RANK in ranks
               else None)
    COMM.Barrier()
    if control is not None:
        for round_ in range(3):
            words = [np.random.default_rng(100 * q + round_).integers(0, 2**63, 5, np.uint64)
                     for q in ranks]
            out = words[ranks.index(RANK)].copy()
            control.or_in_place(out)
            np.testing.assert_array_equal(out, np.bitwise_or.reduce(words))
            payload = [bytes([q % 251]) * (q * 37 * round_) for q in ranks]
            got = control.gather_bytes(payload[ranks.index(RANK)])
            assert got == (payload if RANK == 0 else None)
            answer = b"answer %d " % round_ * (1000 * round_)
            assert control.bcast_bytes(answer if RANK == 0 else b"") == answer
    COMM.Barrier()


def test_a_control_round_sleeps_in_the_kernel(mesh2):
    """Rank 0's OR waits a second for the last rank: its thread switches out a handful
    of times, not thousands (MPI's control exchange polled through such waits)."""
    control = TcpControl(TcpLink(mesh2, 12, range(SIZE), Watch()))
    COMM.Barrier()
    found = None
    if RANK == SIZE - 1:
        time.sleep(1.0)
    out = np.array([1 << RANK], np.uint64)
    switches = _voluntary_switches()
    control.or_in_place(out)
    if RANK == 0:
        found = _voluntary_switches() - switches
    COMM.Barrier()
    assert int(out[0]) == (1 << SIZE) - 1
    if found is not None:
        assert found < 60, f"{found} context switches in a 1 s control round: a polling loop?"


def test_a_slow_reader_fills_the_socket_buffers(mesh2):
    """The last rank's I/O threads stall (its receives posted, its condition held, so no
    receive can complete) while rank 0 sends it 48 MiB: rank 0's sends block in the
    kernel, its caller does not, and every byte arrives."""
    link = TcpLink(mesh2, 6, range(SIZE), Watch())
    pieces, last = 48, SIZE - 1
    COMM.Barrier()
    if RANK == last:
        bufs = [np.empty(1 << 18, np.float32) for _ in range(pieces)]
        recvs = [link.irecv(b, source=0, tag=7) for b in bufs]
        with mesh2.changed:
            COMM.Barrier()
            time.sleep(1.5)
        link.wait_all(recvs)
        ok = all(np.all(b == i) for i, b in enumerate(bufs))
    else:
        COMM.Barrier()
        ok = True
        if RANK == 0:
            sends = [link.isend(np.full(1 << 18, i, np.float32), dest=last, tag=7)
                     for i in range(pieces)]
            time.sleep(1.0)
            ok = not sends[-1].done  # 48 MiB cannot all be in the buffers of a still reader
            link.wait_all(sends)
    COMM.Barrier()
    assert ok


def test_a_peer_that_closes_is_named():
    """The last rank's connections end without its goodbye (as when its process dies):
    a wait on it raises LinkLost naming its rank and host, on each of its neighbours."""
    mesh = open_mesh()
    link = TcpLink(mesh, 7, range(SIZE), Watch())
    last = SIZE - 1
    COMM.Barrier()
    if RANK == last:
        for peer in mesh.peers.values():
            peer.closing = True
            for sock in peer._socks:
                sock.shutdown(socket.SHUT_RDWR)
    elif RANK in (0, last - 1):
        buf = np.empty(4, np.float32)
        with pytest.raises(LinkLost, match=rf"rank {last} \(host {HOSTS[last]}\)") as info:
            link.wait(link.irecv(buf, source=last, tag=9))
        assert info.value.ranks == [last]
        assert mesh.lost is info.value
        with pytest.raises(LinkLost):  # and every later request on it
            link.wait(link.isend(buf, dest=last, tag=9))
    COMM.Barrier()
    mesh.close(grace=0.2)


def test_an_interface_that_does_not_exist():
    """One rank names a missing interface: every rank fails at once, naming it."""
    iface = "hl-absent0" if RANK == SIZE - 1 else ""
    with pytest.raises(tcp.SetupError, match=rf"rank {SIZE - 1} \(host {HOSTS[SIZE - 1]}\).*"
                       r"hl-absent0"):
        open_mesh(iface=iface)


def test_a_taken_port_range():
    held = socket.socket()
    held.bind(("", 0))
    held.listen(1)
    port = COMM.bcast(held.getsockname()[1] if RANK == 0 else None)
    with pytest.raises(tcp.SetupError, match=rf"no free port in HOROLITE_TCP_PORT_RANGE="
                       rf"{port}-{port}"):
        open_mesh(ports=f"{port}-{port}")
    held.close()


def test_an_address_that_refuses(monkeypatch):
    """Rank 0 is told a wrong address for its right neighbour: every rank fails, naming
    both ranks' hosts and the address tried (the others: who never connected)."""
    if RANK == 0:
        monkeypatch.setattr(tcp.tcp_address, "order_for", lambda *a: ["127.0.0.3"])
    with pytest.raises(tcp.SetupError, match=re.escape(f"{where(0)} could not connect to "
                                                       f"{where(1)} at 127.0.0.3:")):
        open_mesh(iface="lo", timeout=2.0)


def test_auto_takes_mpi_where_there_is_rdma(monkeypatch):
    monkeypatch.setattr(tcp, "rdma_devices", lambda: ["mlx5_0"] if RANK == SIZE - 1 else [])
    use, why = tcp.choose("auto", COMM, True)
    assert not use and "mlx5_0" in why
    monkeypatch.setattr(tcp, "rdma_devices", lambda: [])
    assert tcp.choose("auto", COMM, True)[0]
    assert not tcp.choose("tcp", COMM, False)[0]
    assert not tcp.choose("mpi", COMM, True)[0]
