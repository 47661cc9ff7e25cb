"""Waiter._poll: how a polling wait sleeps, with and without an idle wake-up."""
import pytest

from horolite.coordination.tensor_queue import Wake
from horolite.transport.mpi import Waiter


class _Idle(Wake):
    """A Wake that records each wait's timeout (without sleeping) and is set after `until`."""

    def __init__(self, until=None):
        super().__init__()
        self.until, self.waits = until, []

    def wait(self, timeout=None):
        self.waits.append(timeout)
        if self.until is not None and len(self.waits) >= self.until:
            self.set()
        return self.is_set()


class _Recorded(Waiter):
    """A polite Waiter whose sleeps are recorded instead of slept."""

    def __init__(self):
        super().__init__(polite=True)
        self.sleeps = []
        self.sleep = self.sleeps.append


def _ready_after(n):
    calls = []

    def test():
        calls.append(1)
        return len(calls) > n
    return test


def test_a_busy_rank_sleeps_at_most_100_us():
    waiter = _Recorded()
    waiter._poll(_ready_after(200), -1)
    assert waiter.sleeps and max(waiter.sleeps) <= 1e-4


def test_an_idle_rank_sleeps_on_its_wake_up_and_longer():
    idle, waiter = _Idle(), _Recorded()
    waiter._poll(_ready_after(200), -1, idle)
    assert all(s == 0 for s in waiter.sleeps)  # only the yields before the sleeps
    assert idle.waits and max(idle.waits) == pytest.approx(Waiter.IDLE_PAUSE)
    assert idle.waits == sorted(idle.waits)


def test_work_arriving_during_an_idle_wait_brings_back_short_sleeps():
    idle, waiter = _Idle(until=10), _Recorded()
    waiter._poll(_ready_after(300), -1, idle)
    assert len(idle.waits) == 10
    later = [s for s in waiter.sleeps if s]
    assert later and max(later) <= 1e-4
