"""Fixtures for jobs across simulated hosts (bed.py): one bed of three hosts per session."""
import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bed import Bed, BedUnavailable, absent_reason  # noqa: E402


@pytest.fixture(scope="session")
def bed():
    # Skip only where no bed can exist (not root, tools not installed). As root with the
    # tools, a bed that does not build (namespaces refused, sshd exiting, a timeout) is
    # a failure: a broken harness must not pass as skips.
    reason = absent_reason()
    if reason:
        pytest.skip(reason)
    try:
        b = Bed(3).start()
    except BedUnavailable as e:
        pytest.fail(f"root with the tools installed, but the bed of simulated hosts did not "
                    f"start: {e}", pytrace=False)
    try:
        yield b
    finally:
        b.close()


@pytest.fixture(autouse=True)
def no_leftovers(request):
    """After every test on the bed, no process of its job is left on any host. What is left
    is named (with its command line) against the test that left it, then killed, so that
    the next test is judged on its own processes."""
    if "bed" not in request.fixturenames:
        yield
        return
    bed = request.getfixturevalue("bed")
    yield
    deadline = time.monotonic() + 10
    while bed.leftovers() and time.monotonic() < deadline:
        time.sleep(0.2)
    left = bed.describe_leftovers()
    if left:
        bed.kill_leftovers()
    assert not left, f"processes left on hosts: {left}"
