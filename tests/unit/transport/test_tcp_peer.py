"""Messages between two Peers over socketpairs (tcp_link.py), with no MPI: runs of any
length (sequence numbers past 2**32), a garbled stream, an I/O thread that fails, and
requests after a loss. Each failure must reach the requests as LinkLost naming the peer,
never leave a thread dead in silence and a wait without end."""
import socket
import struct
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from horolite.failure.links import LinkLost
from horolite.transport import tcp_link
from horolite.transport.tcp_link import HEADER, Peer, TcpLink


class Pair:
    """Peer 0 and peer 1, `streams` socketpairs between them."""

    def __init__(self, streams=2, express=False):
        pairs = [socket.socketpair() for _ in range(streams)]
        self.changed = threading.Condition()
        self.lost = []
        self.raw = pairs
        self.a = Peer(0, 1, "rank 1 (host b)", [p[0] for p in pairs], self.changed,
                      self.lost.append, express)
        self.b = Peer(1, 0, "rank 0 (host a)", [p[1] for p in pairs], self.changed,
                      self.lost.append, express)

    def wait(self, req, timeout=10.0):
        deadline = time.monotonic() + timeout
        with self.changed:
            while not req.done and time.monotonic() < deadline:
                self.changed.wait(0.05)
        assert req.done, "the request never completed"
        if req.error is not None:
            raise req.error

    def close(self):
        self.a.close(0.5)
        self.b.close(0.5)


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.close()


@pytest.mark.parametrize("receives_first", [True, False])
def test_sequence_numbers_wrap_past_2_to_the_32(pair, receives_first):
    """Counters set just below the field's limit: four messages each way cross it, in
    order and intact (before the fix, the third raised struct.error in the caller)."""
    for peer in (pair.a, pair.b):
        peer._send_seq[(1, -1)] = 2 ** 32 - 2
        peer._recv_seq[(1, -1)] = 2 ** 32 - 2
    bufs = [np.empty(3, np.int64) for _ in range(4)]
    if receives_first:
        recvs = [pair.b.irecv(1, -1, buf) for buf in bufs]
    sends = [pair.a.isend(1, -1, np.full(3, i, np.int64)) for i in range(4)]
    for req in sends:
        pair.wait(req)
    if not receives_first:
        time.sleep(0.1)  # every message arrives before its receive (the early path)
        recvs = [pair.b.irecv(1, -1, buf) for buf in bufs]
    for req in recvs:
        pair.wait(req)
    assert [int(buf[0]) for buf in bufs] == [0, 1, 2, 3]
    assert pair.a._send_seq[(1, -1)] == 2


def test_messages_keep_their_order_when_a_later_stream_overtakes(pair):
    """Peer 1's second message arrives on stream 1 before its first on stream 0 (written
    by hand): receives match by sequence number, not arrival."""
    s0, s1 = pair.raw[0][0], pair.raw[1][0]
    first, second = np.full(2, 7, np.int32), np.full(2, 9, np.int32)
    s1.sendall(HEADER.pack(3, 5, 1, second.nbytes) + second.tobytes())
    time.sleep(0.1)
    s0.sendall(HEADER.pack(3, 5, 0, first.nbytes) + first.tobytes())
    got = [np.empty(2, np.int32), np.empty(2, np.int32)]
    for buf in got:
        pair.wait(pair.b.irecv(3, 5, buf))
    assert [int(g[0]) for g in got] == [7, 9]


@pytest.mark.parametrize("header", [HEADER.pack(1, -1, 0, 2 ** 63),
                                    HEADER.pack(60000, -1, 0, 8)], ids=["length", "link"])
def test_a_garbled_header_fails_the_peers_requests(pair, header):
    req = pair.b.irecv(1, -1, np.empty(4, np.float32))
    pair.raw[0][0].sendall(header)
    with pytest.raises(LinkLost, match=r"rank 0 \(host a\).*garbled header"):
        pair.wait(req, timeout=5)
    assert pair.lost and pair.lost[0].ranks == [0]


def test_a_receiving_thread_that_fails_of_anything_fails_the_requests(pair, monkeypatch):
    """An early message whose buffer cannot be had (MemoryError is not an OSError): the
    thread's end fails the peer's requests with LinkLost, at once."""
    def no_memory(self, length):
        raise MemoryError(f"{length} bytes")
    monkeypatch.setattr(tcp_link._Unexpected, "__init__", no_memory)
    pair.a.isend(1, 4, np.zeros(8, np.float64))  # arrives before any receive: the early path
    time.sleep(0.2)
    req = pair.b.irecv(1, 5, np.empty(1, np.float64))
    with pytest.raises(LinkLost, match=r"receiving thread failed: MemoryError"):
        pair.wait(req, timeout=5)


def test_a_sending_thread_that_fails_of_anything_fails_the_requests(pair, monkeypatch):
    def broken(sock, header, buf):
        raise OverflowError("a frame too long")
    monkeypatch.setattr(tcp_link, "_send_all", broken)
    req = pair.a.isend(1, -1, np.zeros(4, np.int8))
    with pytest.raises(LinkLost, match=r"sending thread failed: OverflowError"):
        pair.wait(req, timeout=5)
    later = pair.a.irecv(1, -1, np.zeros(4, np.int8))
    assert later.done  # a request after the loss is done (failed) at once, not left pending
    with pytest.raises(LinkLost):
        later.Test()


def test_a_strided_buffer_is_refused_on_the_callers_thread(pair):
    with pytest.raises(ValueError, match="contiguous"):
        pair.a.isend(1, -1, np.zeros((4, 4), np.float32)[:, 1])
    with pytest.raises(ValueError, match="contiguous"):
        pair.b.irecv(1, -1, np.zeros((4, 4), np.float32)[:, 1])
    # and the peer still works
    buf = np.empty(3, np.float32)
    recv = pair.b.irecv(1, -1, buf)
    pair.wait(pair.a.isend(1, -1, np.arange(3, dtype=np.float32)))
    pair.wait(recv)
    assert buf.tolist() == [0, 1, 2]


def test_a_reset_connection_names_the_peer(pair):
    req = pair.a.irecv(1, -1, np.empty(4, np.float32))
    for sock in (p[1] for p in pair.raw):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    pair.b.closing = True
    for sock in (p[1] for p in pair.raw):
        sock.shutdown(socket.SHUT_RDWR)
    with pytest.raises(LinkLost, match=r"rank 1 \(host b\)"):
        pair.wait(req, timeout=5)


def test_a_control_message_never_waits_behind_data(monkeypatch):
    """One data stream and the express one: while the data stream's sender is stuck in a
    1 MiB piece (held here), a control message and a small allreduce's piece still go,
    and arrive; then the piece goes too, in its order."""
    stuck, entered = threading.Event(), threading.Event()
    real = tcp_link._send_all

    def held(sock, header, buf):
        if memoryview(buf).nbytes > tcp_link.EXPRESS_BYTES:
            entered.set()
            stuck.wait(10)
        real(sock, header, buf)
    monkeypatch.setattr(tcp_link, "_send_all", held)
    pair = Pair(streams=2, express=True)
    try:
        big = np.arange(1 << 18, dtype=np.float32)
        got_big = np.empty_like(big)
        big_recv = pair.b.irecv(1, -1, got_big)
        big_send = pair.a.isend(1, -1, big)
        assert entered.wait(5)
        control, small = np.array([5, 6], np.int64), np.full(1024, 3, np.float32)
        got_control, got_small = np.empty_like(control), np.empty_like(small)
        recvs = [pair.b.irecv(4, 0, got_control), pair.b.irecv(1, -1, got_small)]
        pair.a.isend(4, 0, control)
        pair.a.isend(1, -1, small)
        for req in recvs:
            pair.wait(req, timeout=5)  # before the fix: behind the held piece, never
        assert got_control.tolist() == [5, 6] and got_small[0] == 3
        assert not big_send.done
        stuck.set()
        pair.wait(big_send)
        pair.wait(big_recv)
        assert np.array_equal(got_big, big)
    finally:
        stuck.set()
        pair.close()


def test_a_wait_calls_the_watch_while_other_links_keep_completing():
    """A wait on a silent link while another link of the same mesh completes a message
    every 20 ms: the collective watch still runs about every WATCH_EVERY (before, only
    after WATCH_EVERY without any completion, so never here)."""
    pair = Pair(streams=1)
    mesh = SimpleNamespace(job_rank=0, peers={1: pair.a}, changed=pair.changed, lost=None)
    calls = []

    class Watch:
        def watch(self, waited, peer):
            calls.append(waited)
            if waited > 1.0:
                raise TimeoutError("done waiting")
    link = TcpLink(mesh, 9, [0, 1], Watch())
    stop = threading.Event()

    def chatter():
        i = 0
        while not stop.is_set():
            buf = np.empty(1, np.int32)
            recv = pair.a.irecv(3, 0, buf)
            pair.b.isend(3, 0, np.array([i], np.int32))
            pair.wait(recv)
            i += 1
            time.sleep(0.02)
    t = threading.Thread(target=chatter)
    t.start()
    try:
        with pytest.raises(TimeoutError):
            link.wait(link.irecv(np.empty(1, np.int32), source=1, tag=1))
    finally:
        stop.set()
        t.join()
        pair.close()
    assert len(calls) >= 8, calls


def test_an_aborted_peer_fails_both_sides_at_once_and_quietly(pair, caplog):
    """A rank whose job failed ends its connections (abort): its own pending and later
    requests and the other side's fail at once with LinkLost, and nothing is logged at
    ERROR (the runtime says what happened, once)."""
    mine = pair.a.irecv(1, -1, np.empty(4))
    theirs = pair.b.irecv(1, -1, np.empty(4))
    with caplog.at_level("DEBUG", logger="horolite"):
        start = time.monotonic()
        pair.a.abort()
        for req in (mine, theirs, pair.a.isend(1, -1, np.ones(4))):
            with pytest.raises(LinkLost):
                pair.wait(req, timeout=2.0)
        assert time.monotonic() - start < 1.0
    assert [e.ranks for e in pair.lost] == [[0]]  # (b lost a; a's own abort is no loss)
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text



def test_a_killed_rank_s_forked_child_keeps_none_of_its_connections():
    """A process (the rank) with a mesh forks a child (its worker), then is killed: the
    peer sees the connections end at once, although the child lives on for 3 s (it closed
    its copies at the fork: tcp.py's hook)."""
    import os
    import signal
    from horolite.transport import tcp
    pairs = [socket.socketpair() for _ in range(2)]
    rank = os.fork()
    if rank == 0:  # the rank: its peer over pairs' first ends
        try:
            for _, theirs in pairs:
                theirs.close()
            mesh = tcp.TcpMesh(0, lambda q: f"rank {q}")
            mesh.peers[1] = Peer(0, 1, "rank 1", [p[0] for p in pairs], mesh.changed,
                                 mesh._lost)
            tcp._meshes.add(mesh)
            if os.fork() == 0:
                time.sleep(3)  # a worker that outlives the rank
                os._exit(0)
            time.sleep(0.3)
        finally:
            os.kill(os.getpid(), signal.SIGKILL)
    for mine, _ in pairs:
        mine.close()
    changed = threading.Condition()
    peer = Peer(1, 0, "rank 0 (host a)", [p[1] for p in pairs], changed, lambda e: None)
    req = peer.irecv(1, -1, np.empty(4))
    deadline = time.monotonic() + 2.0
    with changed:
        while not req.done and time.monotonic() < deadline:
            changed.wait(0.05)
    os.waitpid(rank, 0)
    assert req.done and isinstance(req.error, LinkLost), "the peer never saw the rank end"
    peer.close(0.1)
