"""Fixtures for jobs across simulated hosts (bed.py): one bed of three hosts per session."""
import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bed import Bed, BedUnavailable, unavailable_reason  # noqa: E402


@pytest.fixture(scope="session")
def bed():
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    try:
        with Bed(3) as b:
            yield b
    except BedUnavailable as e:
        pytest.skip(str(e))


@pytest.fixture
def no_leftovers(bed):
    """After the test, no process of the job is left on any host."""
    yield
    deadline = time.monotonic() + 10
    while bed.leftovers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not bed.leftovers(), f"processes left on hosts: {bed.leftovers()}"
