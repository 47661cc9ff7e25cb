"""The control board's native rounds (native/shm_board.c), with threads standing in for
the ranks of one host (cffi releases the GIL in the waits, so they really run at once):
every round's OR holds every rank's vector of that round, the last to enter wakes the
others, the mailboxes carry bytes, and entering rings exactly the doorbells it should.
The rank-side tests run the same code between processes (tests/parallel)."""
import random
import threading
import time

import numpy as np

from horolite._native import ffi, lib
from horolite.core.wake import Wake

N, WORDS, MAILBOX = 3, 5, 256


def board():
    mem = np.zeros(lib.hl_board_bytes(N, WORDS, MAILBOX), np.uint8)
    return mem, ffi.cast("char *", ffi.from_buffer(mem))


def vector(base, q, parity):
    return np.frombuffer(ffi.buffer(lib.hl_board_vector(base, N, WORDS, MAILBOX, q, parity),
                                    WORDS * 8), np.uint64)


def mailbox(base, q, parity):
    return np.frombuffer(ffi.buffer(lib.hl_board_mailbox(base, N, WORDS, MAILBOX, q, parity),
                                    MAILBOX), np.uint8)


def test_rounds_or_each_rounds_vectors_and_the_last_wakes_the_rest():
    mem, base = board()
    rounds, longest, errors = 300, [0.0], []

    def rank(q):
        rng = random.Random(q)
        out = np.zeros(WORDS, np.uint64)
        try:
            for k in range(rounds):
                if rng.random() < 0.2:  # late now and then: the others sleep in the futex
                    time.sleep(rng.choice([1e-4, 1e-3]))
                v = vector(base, q, k & 1)
                v[:] = 0
                v[k % WORDS] = 1 << q
                v[(k + 1) % WORDS] = k << 8  # a stale slot would show an older round
                mailbox(base, q, k & 1)[:4] = np.frombuffer(f"{q}{k:03d}"[:4].encode(), np.uint8)
                lib.hl_board_enter(base, N, WORDS, MAILBOX, q, k, lib.HL_BOARD_RING_NONE)
                start = time.monotonic()
                # A wake-up lost would show as a wait that ran into its 2 s timeout.
                assert lib.hl_board_wait(base, N, WORDS, MAILBOX, k, 2.0, 1e-6) == 0
                longest[0] = max(longest[0], time.monotonic() - start)
                lib.hl_board_or(base, N, WORDS, MAILBOX, k, ffi.cast("uint64_t *",
                                                                      ffi.from_buffer(out)))
                assert out[k % WORDS] == (1 << N) - 1 and out[(k + 1) % WORDS] == k << 8, (q, k)
                for p in range(N):
                    assert bytes(mailbox(base, p, k & 1)[:4]) == f"{p}{k:03d}"[:4].encode()
                assert lib.hl_board_entered(base, N, WORDS, MAILBOX, q) == k + 1
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(q,)) for q in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    assert longest[0] < 1.5, longest  # the 2 s timeout never ran out


def test_entering_rings_whom_the_round_concerns():
    for ring, woken in ((lib.HL_BOARD_RING_NONE, set()), (lib.HL_BOARD_RING_BUSY, {1}),
                        (lib.HL_BOARD_RING_ALL, {1, 2})):
        mem, base = board()
        lib.hl_board_set_busy(base, N, WORDS, MAILBOX, 1, 1)  # rank 1 has work in flight
        assert lib.hl_board_enter(base, N, WORDS, MAILBOX, 0, 0, ring) == 0
        bells = {q for q in range(N) if lib.hl_board_doorbell(base, N, WORDS, MAILBOX, q).set}
        assert bells == woken, (ring, bells)
        # the last to enter completes the round; ranks already in it are not rung
        lib.hl_board_enter(base, N, WORDS, MAILBOX, 1, 0, lib.HL_BOARD_RING_NONE)
        assert lib.hl_board_enter(base, N, WORDS, MAILBOX, 2, 0, lib.HL_BOARD_RING_ALL) == 1
        assert lib.hl_board_wait(base, N, WORDS, MAILBOX, 0, 0.0, 0.0) == 0
        assert not lib.hl_board_doorbell(base, N, WORDS, MAILBOX, 0).set


def test_the_doorbell_is_a_wake_up_any_thread_can_ring():
    mem, base = board()
    wake = Wake(lib.hl_board_doorbell(base, N, WORDS, MAILBOX, 0))
    assert not wake.is_set() and wake.wait(0.01) is False
    ring = ffi.cast("void (*)(void *)", wake.set_function())  # as native code calls it
    threading.Timer(0.05, lambda: ring(ffi.cast("void *", wake.address))).start()
    assert wake.wait(10) is True and wake.is_set()
    wake.clear()
    assert not wake.is_set()
    wake.set()
    assert wake.wait(0) is True
