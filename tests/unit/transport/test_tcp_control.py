"""The control exchange's log2(n) shapes (tcp_control.py) at 1 to 9 participants (powers of
two and the folds between them), each participant a thread with Peers over socketpairs
to its partners only: OR, gather and broadcast against NumPy and Python references."""
import socket
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from horolite.transport.tcp_control import TcpControl, partners
from horolite.transport.tcp_link import Peer, TcpLink


def meshes(n):
    """n meshes, each connected to its participant's control partners alone."""
    found = [SimpleNamespace(job_rank=r, peers={}, changed=threading.Condition(), lost=None)
             for r in range(n)]
    for r in range(n):
        assert r not in partners(r, n)
        for q in partners(r, n):
            assert r in partners(q, n)  # (symmetric: both ends open it)
            if q > r:
                a, b = socket.socketpair()
                for me, other, sock in ((r, q, a), (q, r, b)):
                    mesh = found[me]
                    mesh.peers[other] = Peer(me, other, f"rank {other}", [sock], mesh.changed,
                                             lambda error: None)
    return found


class Silent:
    def watch(self, waited, peer):
        pass


@pytest.mark.parametrize("n", range(1, 10))
def test_or_gather_and_broadcast_in_log_steps(n):
    found = meshes(n)
    rng = np.random.default_rng(n)
    words = [rng.integers(0, 2 ** 63, 4, dtype=np.uint64) for _ in range(n)]
    payloads = [bytes([r]) * (r * 13) for r in range(n)]
    answer = b"rank 0 answers %d" % n
    results, errors = {}, []

    def participant(r):
        try:
            control = TcpControl(TcpLink(found[r], 4, range(n), Silent()))
            for round_ in range(3):
                out = words[r].copy()
                control.or_in_place(out)
                gathered = control.gather_bytes(payloads[r])
                said = control.bcast_bytes(answer if r == 0 else b"")
                results[(r, round_)] = (out, gathered, said)
        except BaseException as e:  # (reported below, with its rank)
            errors.append((r, e))

    threads = [threading.Thread(target=participant, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a participant never finished"
    want_or = np.bitwise_or.reduce(words)
    for (r, _), (out, gathered, said) in results.items():
        np.testing.assert_array_equal(out, want_or)
        assert gathered == (payloads if r == 0 else None)
        assert said == answer
    closing = [threading.Thread(target=peer.close, args=(2.0,))
               for mesh in found for peer in mesh.peers.values()]
    for t in closing:
        t.start()
    for t in closing:
        t.join()


def test_partners_grow_as_log2():
    assert partners(0, 1) == set()
    assert partners(0, 2) == {1}
    assert partners(5, 8) == {4, 6, 7, 3, 1}
    assert max(len(partners(r, 64)) for r in range(64)) <= 2 * 6
    assert partners(2, 5, "ring") == {1, 3}
