"""The sockets world's communicators, n ranks as threads of this process joined by
socket pairs: each collective's result against NumPy's, on 1-4 ranks."""
import socket
import threading

import numpy as np
import pytest

from horolite.failure.links import LinkLost
from horolite.world import codec
from horolite.world.sockets_comm import BOR, COMM_NULL, IN_PLACE, LAND, MAX, UNDEFINED, Comm, Win
from horolite.world.requests import ANY_SOURCE, REQUEST_NULL, Request, Status
from horolite.world.sockets_mesh import HEADER, Mesh


def make_world(n):
    pairs = {}
    for a in range(n):
        for b in range(a + 1, n):
            pairs[a, b] = socket.socketpair()
    meshes = []
    for r in range(n):
        socks = {q: pairs[min(r, q), max(r, q)][0 if r < q else 1] for q in range(n) if q != r}
        meshes.append(Mesh(r, n, socks, lambda q: f"rank {q}"))
    return [Comm(m, list(range(n)), 1) for m in meshes]


def in_threads(fns):
    """Each of `fns` on a thread of its own (a rank): their results and errors."""
    results, errors = [None] * len(fns), []

    def run(i):
        try:
            results[i] = fns[i]()
        except BaseException as e:  # noqa: B902 (reported by the caller)
            errors.append((i, e))
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results, errors


def on_every_rank(comms, fn):
    results, errors = in_threads([lambda c=c: fn(c) for c in comms])
    assert not errors, errors
    return results


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_object_collectives(n):
    comms = make_world(n)
    got = on_every_rank(comms, lambda c: (c.allgather(("r", c.Get_rank())),
                                          c.bcast({"x": c.Get_rank()} if c.Get_rank() == n - 1 else None, root=n - 1),
                                          c.allreduce(c.Get_rank() + 1),
                                          c.allreduce(c.Get_rank() != 1, op=LAND),
                                          c.gather(c.Get_rank() * 10, root=0)))
    for r, (gathered, bc, total, land, g) in enumerate(got):
        assert gathered == [("r", q) for q in range(n)]
        assert bc == {"x": n - 1}
        assert total == n * (n + 1) // 2
        assert land == (n == 1)
        assert g == ([q * 10 for q in range(n)] if r == 0 else None)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_buffer_collectives_against_numpy(n):
    comms = make_world(n)
    inputs = [np.arange(5, dtype=np.uint64) * (r + 1) + (1 << r) for r in range(n)]

    def run(c):
        r = c.Get_rank()
        out = np.zeros(5, dtype=np.uint64)
        Request.Waitall([c.Iallreduce(inputs[r], out, op=BOR)])
        inplace = inputs[r].astype(np.int64)
        c.Iallreduce(IN_PLACE, inplace, op=MAX).Wait()
        b = np.full(3, r, dtype=np.float32)
        c.Ibcast(b, root=n - 1).Wait()
        every = np.zeros(2 * n, dtype=np.int64)
        c.Iallgather(np.array([r, -r], dtype=np.int64), every).Wait()
        rows = np.zeros(n, dtype=np.int64)
        c.Ialltoall(np.arange(n, dtype=np.int64) + 100 * r, rows).Wait()
        data = bytes([r]) * (r + 1)
        lengths = np.zeros(n, dtype=np.int64) if r == 0 else None
        c.Igather(np.array([len(data)], dtype=np.int64), lengths, root=0).Wait()
        gathered = None
        if r == 0:
            offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
            gathered = np.zeros(int(lengths.sum()), dtype=np.uint8)
            c.Igatherv(np.frombuffer(data, np.uint8), [gathered, lengths, offsets, None], 0).Wait()
        else:
            c.Igatherv(np.frombuffer(data, np.uint8), None, 0).Wait()
        return out, inplace, b, every, rows, gathered
    for r, (out, inplace, b, every, rows, gathered) in enumerate(on_every_rank(comms, run)):
        assert (out == np.bitwise_or.reduce(inputs)).all()
        assert (inplace == np.max([i.astype(np.int64) for i in inputs], axis=0)).all()
        assert (b == n - 1).all()
        assert every.tolist() == [v for q in range(n) for v in (q, -q)]
        assert rows.tolist() == [r + 100 * q for q in range(n)]
        if r == 0:
            assert gathered.tobytes() == b"".join(bytes([q]) * (q + 1) for q in range(n))


@pytest.mark.parametrize("n", [2, 3, 4])
def test_point_to_point_order_any_source_and_status(n):
    comms = make_world(n)

    def run(c):
        r = c.Get_rank()
        if r != 0:
            for i in range(3):  # never overtaking: 0, 1, 2 in order
                c.Isend(np.array([r, i], dtype=np.int64), dest=0, tag=5)
            return None
        seen = []
        for _ in range(3 * (n - 1)):
            buf = np.zeros(2, dtype=np.int64)
            status = Status()
            req = c.Irecv(buf, source=ANY_SOURCE, tag=5)
            req.Wait(status)
            assert status.Get_source() == buf[0] and status.Get_count() == 16
            seen.append(tuple(buf))
        return seen
    seen = on_every_rank(comms, run)[0]
    for q in range(1, n):
        assert [i for src, i in seen if src == q] == [0, 1, 2]


def test_a_completed_request_equals_request_null_and_waitany():
    a, b = make_world(2)
    buf = np.zeros(1, dtype=np.uint8)
    first = a.Irecv(buf, source=1, tag=1)
    second = a.Irecv(np.zeros(1, dtype=np.uint8), source=1, tag=2)
    assert first != REQUEST_NULL and bool(first)
    b.Isend(np.array([7], dtype=np.uint8), dest=0, tag=2)
    reqs = [first, second]
    assert Request.Waitany(reqs) == 1
    assert second == REQUEST_NULL and first != REQUEST_NULL
    assert Request.Testsome(reqs) == []
    b.Isend(np.array([9], dtype=np.uint8), dest=0, tag=1)
    first.Wait()
    assert buf[0] == 9 and Request.Testsome(reqs) is None


@pytest.mark.parametrize("n", [3, 4])
def test_split_dup_and_groups_keep_their_messages_apart(n):
    comms = make_world(n)

    def run(c):
        r = c.Get_rank()
        half = c.Split(r % 2, key=-r)  # reversed order within each half
        none = c.Split(0 if r == 0 else UNDEFINED, r)
        dup = c.Dup()
        group = c.Create_group(c.Get_group().Incl([0, n - 1])) if r in (0, n - 1) else None
        return (half.ranks, half.allgather(r), none is COMM_NULL, dup.allreduce(r),
                group.allgather(r) if group else None)
    for r, (ranks, gathered, null, total, pair) in enumerate(on_every_rank(comms, run)):
        assert ranks == sorted((q for q in range(n) if q % 2 == r % 2), reverse=True)
        assert gathered == ranks
        assert null == (r != 0)
        assert total == sum(range(n))
        assert pair == ([0, n - 1] if r in (0, n - 1) else None)


@pytest.mark.parametrize("n", [1, 3])
def test_shared_window_is_shared(n):
    comms = make_world(n)

    def run(c):
        win = Win.Allocate_shared(64 * (c.Get_rank() + 1), 1, comm=c)
        mine, _ = win.Shared_query(c.Get_rank())
        np.frombuffer(mine, dtype=np.uint8)[:] = c.Get_rank() + 1
        c.Barrier()
        return [bytes(win.Shared_query(q)[0]) for q in range(n)]
    for seen in on_every_rank(comms, run):
        assert seen == [bytes([q + 1]) * 64 * (q + 1) for q in range(n)]


def test_a_closed_connection_fails_waits_on_that_peer_naming_it():
    a, b = make_world(2)
    req = a.Irecv(np.zeros(1, dtype=np.uint8), source=1, tag=3)
    b.mesh.close()
    with pytest.raises(LinkLost, match="rank 1"):
        req.Wait()
    with pytest.raises(LinkLost):
        a.Irecv(np.zeros(1, dtype=np.uint8), source=1, tag=4).Wait()


def test_a_peer_that_dies_inside_a_message_fails_the_receive_it_was_filling():
    """The message's receive is claimed when its header arrives; the peer's end half-way
    through the bytes fails that receive naming the peer (it waited for ever before)."""
    ours, theirs = socket.socketpair()
    mesh = Mesh(0, 2, {1: ours}, lambda q: f"rank {q} (host b)")
    comm = Comm(mesh, [0, 1], 1)
    req = comm.Irecv(np.zeros(1 << 20, dtype=np.uint8), source=1, tag=7)
    theirs.sendall(HEADER.pack(1, 7, 1 << 20) + bytes(1000))
    theirs.close()
    done = threading.Event()
    threading.Thread(target=lambda: (pytest.raises(LinkLost, req.Wait), done.set()),
                     daemon=True).start()
    assert done.wait(5), "the receive was never failed"
    assert 1 in mesh.lost and "rank 1 (host b)" in str(mesh.lost[1])
    mesh.close()


def test_codec_refuses_code_and_garbage():
    value = {"a": [1, 2.5, None, True, b"x", ("t", -3)], 7: np.arange(4).reshape(2, 2)}
    back = codec.decode(codec.encode(value))
    assert back["a"] == value["a"] and (back[7] == value[7]).all()
    with pytest.raises(TypeError, match="function"):
        codec.encode(lambda: 0)
    for bad in (b"", b"z", b"s\xff\xff\xff\xff\xff\xff\xff\x7f", codec.encode(1) + b"N"):
        with pytest.raises(ValueError):
            codec.decode(bad)
