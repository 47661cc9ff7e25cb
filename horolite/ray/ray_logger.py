"""Values a worker sends to the driver while it trains: Horovod's ``ray_logger``.

    from horolite.ray import ray_logger
    ray_logger.log({"epoch": epoch, "loss": loss})   # in the training function

RayExecutor's ``run(..., callbacks=[...])`` and ``execute(..., callbacks=[...])`` call
each callback with every value rank 0 logs, in the driver, while the job runs. Values
logged on other ranks, or where no callback listens, are dropped.
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Callable, List, Optional

__all__ = ["log", "configure", "Listener"]

_queue = None
_warned = False


def configure(queue) -> None:
    """Where log() sends (the driver's queue; None: nowhere)."""
    global _queue
    _queue = queue


def _rank() -> int:
    import horolite
    if horolite.is_initialized():
        return horolite.rank()
    return int(os.environ.get("HOROLITE_RANK", "0") or 0)


def log(info: Any) -> None:
    """Send `info` (anything Ray can serialize) to the driver's callbacks, from rank 0."""
    global _warned
    if _queue is None:
        if not _warned:
            warnings.warn("ray_logger.log() called, but no callback listens: pass "
                          "callbacks= to RayExecutor.run() or execute()")
            _warned = True
        return
    if _rank() == 0:
        _queue.put(info)


class Listener:
    """The driver's end: a Ray queue the workers put into, and the callbacks it feeds."""

    def __init__(self, callbacks: Optional[List[Callable[[Any], Any]]]):
        self.callbacks = list(callbacks or [])
        self.queue = None
        if self.callbacks:
            from ray.util.queue import Queue
            self.queue = Queue(actor_options={"num_cpus": 0})

    def drain(self) -> None:
        if self.queue is None:
            return
        for info in self.queue.get_nowait_batch(self.queue.qsize()):
            for callback in self.callbacks:
                callback(info)

    def close(self) -> None:
        if self.queue is not None:
            self.drain()
            self.queue.shutdown()
            self.queue = None
