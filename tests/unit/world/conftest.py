"""What the world's unit tests share."""
import threading

import pytest


@pytest.fixture
def thread_limit_once(monkeypatch):
    """`thread_limit_once(matches)`: the first start of a thread whose name `matches`
    raises as at the process's thread limit; every other start is real."""
    def arm(matches):
        real, failed = threading.Thread.start, []

        def start(self):
            if matches(self.name) and not failed:
                failed.append(self.name)
                raise RuntimeError("can't start new thread")
            return real(self)
        monkeypatch.setattr(threading.Thread, "start", start)
    return arm
