"""The two kinds of Ray actor a horolite job runs: its workers and its rendezvous.

A worker is a plain Python object Ray runs in a process of its own; the training
function runs in it as it would in a rank horolite-run started, once the layout's
variables are in its environment. The rendezvous actor serves the key-value store the
ranks meet at (horolite/world/rendezvous.py) from wherever Ray puts it, so the driver
may be a Ray Client outside the cluster (an elastic job's driver reads and writes it
there through put() and items()).
"""
from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any, Callable, Dict, Optional

import ray

from .layout import NodeInfo

__all__ = ["Worker", "Rendezvous", "node_info"]

_log = logging.getLogger("horolite.ray")
# How long a worker whose function returned, while another rank's raised, waits to hear
# of that failure before it shuts horolite down anyway (settle()).
NOTICE_SECONDS = 2.0


def node_info() -> NodeInfo:
    """Where the calling process runs (a worker's, or a Ray Train worker's)."""
    return NodeInfo(ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(),
                    socket.gethostname(), os.getpid(),
                    tuple(str(g) for g in ray.get_gpu_ids()))


def settle_after_failure(error: BaseException = None) -> None:
    """After the training function raised: tell the other ranks, as an uncaught exception
    does under horolite-run (their collectives fail at once, naming this rank, instead of
    waiting for it), then shut horolite's runtime down here, so the worker stays alive for
    Ray to report the error (a doomed rank otherwise ends its process a few seconds later)
    and the next run() can call hvd.init() again."""
    import horolite
    from horolite.runtime import registry
    runtime = registry.current() if horolite.is_initialized() else None
    if runtime is None:
        return
    if error is not None and runtime.doomed is None and runtime.size > 1:
        try:
            runtime.report_exception(error, error.__traceback__)
        except Exception as e:  # (the error Ray reports is the training function's)
            _log.debug("telling the other ranks: %r", e)
    elif error is None and runtime.doomed is None:
        # (a rank whose function returned while another's raised: the notice is on its
        # way; a runtime that never hears it still stops, the others having stopped)
        deadline = time.monotonic() + NOTICE_SECONDS
        while runtime.doomed is None and time.monotonic() < deadline:
            time.sleep(0.01)
    try:
        horolite.shutdown()
    except Exception as e:
        _log.debug("shutdown after the failure: %r", e)


class Worker:
    """One rank: Horovod's BaseHorovodWorker's methods, on which RayExecutor calls."""

    def __init__(self):
        self.executable = None

    def node(self) -> NodeInfo:
        return node_info()

    def hostname(self) -> str:
        return socket.gethostname()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def get_gpu_ids(self):
        return ray.get_gpu_ids()

    def share_gpus(self, own, order, local_rank: int, pick: bool) -> None:
        """See the GPUs of `order` (ObjectRefs of GPU ids: this host's workers', in
        local-rank order; `own`, this worker's, comes resolved): an elastic worker learns them here,
        without the driver waiting for any actor to start. A worker that died before it
        said is left out."""
        from .gpus import shared_gpus
        ids = []
        for ref in order:
            try:
                ids.append(ray.get(ref, timeout=60))
            except Exception as e:
                _log.debug("a peer's GPU ids: %r", e)
        os.environ.update(shared_gpus([str(g) for g in own],
                                      [[str(g) for g in i] for i in ids], local_rank, pick))

    def update_env_vars(self, env_vars: Dict[str, Any]) -> None:
        os.environ.update({k: str(v) for k, v in env_vars.items()})

    def env_vars(self) -> Dict[str, str]:
        return dict(os.environ)

    def start_executable(self, executable_cls: Optional[type] = None, executable_args=None,
                         executable_kwargs=None) -> None:
        if executable_cls is not None:
            self.executable = executable_cls(*(executable_args or []),
                                             **(executable_kwargs or {}))

    def execute(self, fn: Callable[[Any], Any]) -> Any:
        try:
            return fn(self.executable)
        except BaseException as e:
            from .failures import mark
            mark(e)  # (the runtime's or the training code's: read before it shuts down)
            settle_after_failure(e)
            raise

    def settle(self) -> None:
        """After another rank's function failed: stop horolite here too (every rank then
        starts a new world at the next run()'s hvd.init())."""
        settle_after_failure()

    def set_queue(self, queue) -> None:
        """Where ray_logger.log() sends (None: nowhere)."""
        from . import ray_logger
        ray_logger.configure(queue)

    def ping(self) -> int:
        return os.getpid()


class Rendezvous:
    """The job's rendezvous server, in an actor of its own (no CPU reserved)."""

    def __init__(self, key: bytes):
        from horolite.world.rendezvous import RendezvousServer
        self._server = RendezvousServer(key, host="0.0.0.0", port=0)

    def address(self):
        return ray.util.get_node_ip_address(), self._server.port

    def put(self, scope: str, key: str, value: bytes) -> None:
        self._server.put(scope, key, value)

    def items(self, scope: str) -> Dict[str, bytes]:
        return self._server.items(scope)

    def close(self) -> None:
        self._server.close()
