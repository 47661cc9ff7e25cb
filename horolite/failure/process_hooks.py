"""Process-wide hooks: how this process ends, and what a forked child may do.

- An uncaught exception (sys.excepthook) and SIGTERM tell the runtime, which tells
  the other ranks why this rank is going (failure.py) before the process goes.
- sys.exit's code is remembered, so the other ranks can be told it, and so a process
  that must skip MPI_Finalize (see basics._shutdown_at_exit) still exits with it.
- A child forked after init() shares the parent's MPI connection: it must never use
  it. Its collectives raise at once (ForkedRuntime), and when it exits through the
  interpreter (sys.exit, the end of its code) it leaves by os._exit after the other
  exit handlers, so MPI_Finalize never runs on the parent's connection.
"""
from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
from typing import Callable, Optional

from ..errors import HorovodInternalError

__all__ = ["install", "in_init_process", "exit_code", "exit_now", "ForkedRuntime"]

_installed = False
_init_pid: Optional[int] = None
_exit_code: Optional[int] = None
_get_runtime: Callable = lambda: None
_after_fork: Optional[Callable] = None


def install(get_runtime: Callable, after_fork_in_child: Callable) -> None:
    """Once per process, at init(): the hooks above. `get_runtime()` gives the runtime."""
    global _installed, _init_pid, _get_runtime, _after_fork
    _init_pid = os.getpid()
    _get_runtime = get_runtime
    _after_fork = after_fork_in_child
    if _installed:
        return
    _installed = True
    previous_hook = sys.excepthook
    original_exit = sys.exit

    def excepthook(exc_type, exc, tb):
        global _exit_code
        _exit_code = 130 if issubclass(exc_type, KeyboardInterrupt) else 1
        rt = _get_runtime() if in_init_process() else None  # (a forked child's is not real)
        if rt is not None:
            try:
                rt.report_exception(exc, tb)
            except Exception:  # never hide the user's own traceback
                logging.getLogger("horolite").exception("reporting the failure failed")
        previous_hook(exc_type, exc, tb)

    def exit(status=None):  # noqa: A001 (sys.exit, remembering its code)
        global _exit_code
        if status is None:
            _exit_code = 0
        elif isinstance(status, int):
            _exit_code = status
        else:
            _exit_code = 1  # sys.exit("message") prints it and exits 1
        original_exit(status)

    sys.excepthook = excepthook
    sys.exit = exit
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)
        # A child is born with the default action: a Python handler could lose a SIGTERM
        # that arrives while the child starts (multiprocessing's Pool.terminate then waits
        # forever on a worker).
        os.register_at_fork(before=lambda: _set_sigterm(signal.SIG_DFL),
                            after_in_parent=lambda: _set_sigterm(_on_sigterm))
    os.register_at_fork(after_in_child=_in_child)
    atexit.register(_exit_forked_child)


def in_init_process() -> bool:
    return os.getpid() == _init_pid


def exit_code() -> Optional[int]:
    """The code sys.exit was called with, or 1/130 after an uncaught exception; None if
    neither happened (the code ran to its end, or raised SystemExit directly)."""
    return _exit_code


def exit_now(code: int) -> None:
    """End the process at once (no MPI_Finalize), with what was printed flushed."""
    for handler in logging.getLogger("horolite").handlers:
        try:
            handler.flush()
        except Exception:
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def _set_sigterm(handler) -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)


def _on_sigterm(signum, frame):
    rt = _get_runtime() if in_init_process() else None
    if rt is not None:
        rt.report_signal(signum)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _in_child() -> None:
    if signal.getsignal(signal.SIGTERM) is _on_sigterm:  # forked from a thread other than main
        _set_sigterm(signal.SIG_DFL)
    if _after_fork is not None and _init_pid is not None:
        _after_fork()


def _exit_forked_child() -> None:
    """Registered at the first init(), so it runs after the exit handlers registered later."""
    if _init_pid is not None and not in_init_process():
        exit_now(0 if _exit_code is None else _exit_code)


class ForkedRuntime:
    """What a forked child sees in place of the runtime: the parent's topology, and an
    error for anything that would use MPI."""

    def __init__(self, parent):
        self.topology = parent.topology
        self.rank, self.size = parent.rank, parent.size
        self.config = parent.config
        self.doomed = None
        self.queue = self
        self._message = (f"this process ({os.getpid()}) was forked from rank {parent.rank} "
                         f"(process {_init_pid}) after horolite.init(); it cannot run "
                         "collectives, since MPI belongs to the parent. Run collectives in "
                         "the parent, or start workers with multiprocessing's 'spawn' "
                         "method and init() there")

    def submit(self, entry, ring: bool = True):
        raise HorovodInternalError(f"tensor '{entry.request.name}': {self._message}")

    def shutdown(self, *args, **kwargs) -> None:
        pass

    def __getattr__(self, name):
        raise HorovodInternalError(f"horolite.{name}: {self._message}")
