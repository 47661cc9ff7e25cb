"""The ring's paced sends over horolite's TCP links (transport/ring.py): a rank that
enters an allreduce late finds at most WINDOW pieces that arrived before their receives
(review L1), not a whole segment, and every result stays right. Ranks on threads, over
Peers on socketpairs (no MPI)."""
import socket
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from horolite.core.ops import ReduceOp
from horolite.transport import ring as ring_module
from horolite.transport.ring import Ring, even_bounds
from horolite.transport.tcp_link import Peer, TcpLink

PIECE = 4096
PIECES = 64  # per segment


class Peak(dict):
    """A Peer's early messages ({key: _Unexpected}), with the most bytes ever held at once."""
    peak = 0

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.peak = max(self.peak, sum(u.data.nbytes for u in self.values()))


def run_ring(n, work, late=0.0):
    """Run work(ring, r) on n ranks over a ring of Peers; rank 1 starts `late` s after the
    others. The peak early bytes rank 1 held from rank 0."""
    changed = threading.Condition()
    peers = [{} for _ in range(n)]
    for r in range(n):  # r's connections to its right neighbour
        q = (r + 1) % n
        if q in peers[r]:
            continue
        pairs = [socket.socketpair() for _ in range(2)]
        peers[r][q] = Peer(r, q, f"rank {q}", [p[0] for p in pairs], changed, lambda e: None)
        peers[q][r] = Peer(q, r, f"rank {r}", [p[1] for p in pairs], changed, lambda e: None)
    peers[1][0]._unexpected = Peak()
    errors = []

    def rank(r):
        try:
            time.sleep(late if r == 1 else 0.0)
            mesh = SimpleNamespace(job_rank=r, peers=peers[r], changed=changed, lost=None)
            work(Ring(TcpLink(mesh, 1, list(range(n)), SimpleNamespace())), r)
        except BaseException as e:  # (reported below, not lost in the thread)
            errors.append(e)
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for mine in peers:
        for peer in mine.values():
            peer.abort()  # (at once: a goodbye would wait on the other side)
    assert not errors, errors
    return peers[1][0]._unexpected.peak


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(ring_module, "PIECE_BYTES", PIECE)


def late_allreduce(late):
    count = 2 * PIECES * PIECE // 4
    bufs = [np.arange(count, dtype=np.float32) * (r + 1) for r in range(2)]
    peak = run_ring(2, lambda ring, r: ring.allreduce(bufs[r], ReduceOp.SUM), late)
    expected = np.arange(count, dtype=np.float32) * 3
    assert all(np.array_equal(b, expected) for b in bufs)
    return peak


def test_a_late_rank_finds_at_most_a_window_of_early_pieces(small_pieces):
    peak = late_allreduce(0.05)
    assert peak <= ring_module.WINDOW * PIECE, peak // PIECE


def test_unpaced_the_late_rank_held_the_whole_segment(small_pieces, monkeypatch):
    """What the pacing removes (PACED False, as before): the test above measures it."""
    monkeypatch.setattr(ring_module, "PACED", False)
    assert late_allreduce(0.05) > ring_module.WINDOW * PIECE * 4


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("window", [1, 3])
def test_every_result_is_right_with_any_window(small_pieces, monkeypatch, n, window):
    """Allreduce (in place and not), reducescatter's and allgather's halves, against NumPy,
    with segments of unequal pieces; one rank late."""
    monkeypatch.setattr(ring_module, "WINDOW", window)
    count = n * 20 * PIECE // 8 + 5  # (float64: 20 pieces a segment, and an odd tail)
    rng = np.random.default_rng(n * 10 + window)
    data = [rng.integers(0, 9, count).astype(np.float64) for _ in range(n)]
    total = np.sum(data, axis=0)
    bounds = even_bounds(count, n)
    out = {}

    def work(ring, r):
        a = data[r].copy()
        ring.allreduce(a, ReduceOp.SUM)
        b = np.empty_like(a)
        ring.allreduce_from(data[r], b, ReduceOp.SUM)
        c = data[r].copy()
        ring.scatter_reduce(c, bounds, ReduceOp.SUM)
        d = np.zeros(count)
        d[bounds[r]:bounds[r + 1]] = data[r][bounds[r]:bounds[r + 1]]
        ring.allgather(d, bounds)
        out[r] = (a, b, c[bounds[r]:bounds[r + 1]], d)
    run_ring(n, work, late=0.02)
    gathered = np.concatenate([data[q][bounds[q]:bounds[q + 1]] for q in range(n)])
    for r in range(n):
        a, b, c, d = out[r]
        assert np.array_equal(a, total) and np.array_equal(b, total)
        assert np.array_equal(c, total[bounds[r]:bounds[r + 1]])
        assert np.array_equal(d, gathered)
