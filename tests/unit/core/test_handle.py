"""The handle: waiting (before, during and after completion), timeouts, callbacks,
and completing a fused batch's handles at once."""
import threading
import time

import pytest

from horolite.core.handle import Handle


def complete_later(fn, delay=0.05):
    t = threading.Thread(target=lambda: (time.sleep(delay), fn()))
    t.start()
    return t


def test_waiters_before_and_after_completion_all_get_the_result():
    h = Handle("x")
    got = []
    waiters = [threading.Thread(target=lambda: got.append(h.result())) for _ in range(3)]
    for w in waiters:
        w.start()
    time.sleep(0.05)
    assert not h.done() and got == []
    h._set_result(42)
    for w in waiters:
        w.join(5)
    assert got == [42, 42, 42] and h.done() and h.result() == 42


def test_a_timed_out_wait_can_wait_again():
    h = Handle("slow")
    with pytest.raises(TimeoutError, match="'slow'"):
        h.result(timeout=0.01)
    t = complete_later(lambda: h._set_exception(ValueError("boom")))
    with pytest.raises(ValueError, match="boom"):
        h.result(timeout=5)
    t.join()
    assert isinstance(h.exception(), ValueError)


def test_set_results_completes_plain_and_transformed_handles_and_runs_callbacks():
    plain = [Handle(f"p{i}") for i in range(4)]
    shaped = Handle("t", transform=lambda v: v * 10)
    seen = []
    plain[1].add_done_callback(lambda h: seen.append(h.result()))
    waiter_got = []
    waiter = threading.Thread(target=lambda: waiter_got.append(plain[3].result()))
    waiter.start()
    time.sleep(0.02)
    Handle.set_results(plain + [shaped], [0, 1, 2, 3, 4])
    waiter.join(5)
    assert [h.result() for h in plain] == [0, 1, 2, 3] and shaped.result() == 40
    assert seen == [1] and waiter_got == [3]
    # completing again changes nothing (exactly one result per handle)
    Handle.set_results(plain, [9, 9, 9, 9])
    plain[0]._set_result(9)
    assert [h.result() for h in plain] == [0, 1, 2, 3]
    late = []
    plain[2].add_done_callback(lambda h: late.append(h.result()))
    assert late == [2]
