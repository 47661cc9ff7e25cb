"""The queue's wake-up (Wake): what the background thread waits on between cycles."""
import threading
import time

import numpy as np

from horolite.coordination.tensor_queue import Entry, TensorQueue, Wake
from horolite.core.handle import Handle
from horolite.core.messages import Kind, Request


def test_wake_behaves_as_an_event():
    w = Wake()
    assert not w.is_set()
    t0 = time.monotonic()
    assert w.wait(0.05) is False and time.monotonic() - t0 >= 0.04  # timed out, unset
    w.set()
    w.set()  # twice: no error, still set
    assert w.is_set() and w.wait(0) is True and w.wait(0) is True  # stays set until cleared
    w.clear()
    w.clear()
    assert not w.is_set() and w.wait(0) is False


def test_a_set_from_another_thread_wakes_the_waiter_at_once():
    w = Wake()
    woke = []

    def waiter():
        woke.append(w.wait(10.0))
    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.05)
    t0 = time.monotonic()
    w.set()
    t.join(5.0)
    assert woke == [True] and time.monotonic() - t0 < 5.0


def test_no_submission_is_missed_between_take_and_the_next_wait():
    # A submission that lands while the background thread takes the previous ones
    # leaves the wake set (or its entry taken): a wait never sleeps through work.
    q = TensorQueue()
    stop = threading.Event()
    taken = []

    def background():
        while not stop.is_set() or q.has_inflight():
            q.wake.wait(60.0)  # a lost wake-up would sleep past the deadline below
            for e in q.take_new():
                taken.append(e.request.name)
                q.finish(e.request.name)
    t = threading.Thread(target=background)
    t.start()
    names = [f"t{i}" for i in range(2000)]
    for name in names:
        q.submit(Entry(Request(name, Kind.ALLREDUCE, "float32", (1,), 1), np.ones(1), Handle(name)))
    deadline = time.monotonic() + 10.0
    while len(taken) < len(names) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert taken == names
    stop.set()
    q.wake.set()
    t.join(5.0)
