"""``RayExecutor``: Horovod 0.28.1's driver for a job whose ranks are Ray actors.

start() reserves a placement group (one bundle per worker, packed; or ``num_hosts``
bundles of ``num_workers_per_host`` workers, one per node), starts a worker actor in
each place and a rendezvous actor, numbers the workers by machine (layout.py) and puts
each one's identity and the driver's HOROLITE_*/HOROVOD_* settings in its environment.
The training function then calls ``hvd.init()`` as under horolite-run.

When a worker's actor dies (its process killed, its node lost), the survivors'
collectives fail naming its rank and node; run() waits for them (at most the settings'
timeout), then raises HorovodInternalError naming the dead rank, with Ray's own error as
its cause. An error the training function raised reaches the caller as Ray raises it.
"""
from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from typing import Any, Callable, Dict, List, Optional

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import (get_current_placement_group, placement_group,
                                      remove_placement_group)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from horolite.errors import HorovodInternalError

from . import actors
from .failures import RAY, classify
from .ray_logger import Listener
from .layout import forwarded_settings, nic_settings, place

__all__ = ["RayExecutor", "MiniSettings"]

_log = logging.getLogger("horolite.ray")


@dataclasses.dataclass
class MiniSettings:
    """Horovod's settings for a Ray job (the fields its RayExecutor reads)."""
    nics: Optional[set] = None  # the interfaces the ranks use (layout.nic_settings)
    verbose: int = 1
    key: Optional[str] = dataclasses.field(default=None, repr=False)  # (unused: see docs)
    ssh_port: Optional[int] = None
    ssh_identity_file: Optional[str] = None
    timeout_s: int = 300
    placement_group_timeout_s: int = 100
    elastic: bool = False


class RayExecutor:
    """A horolite job on Ray, with Horovod's RayExecutor's names, order and defaults.

    Give ``num_workers`` (placed where Ray finds room, packed), or ``num_hosts`` and
    ``num_workers_per_host`` (that many on each of that many nodes). Inside a placement
    group of its own caller's (a Ray Tune trial's, say) the workers use its bundles
    unless ``use_current_placement_group=False``.
    """

    @classmethod
    def create_settings(cls, timeout_s=30, ssh_identity_file=None, ssh_str=None,
                        placement_group_timeout_s=100, nics=None) -> MiniSettings:
        """timeout_s bounds the ranks' wait for each other; ssh is unused (Ray starts the
        workers), kept for Horovod's signature."""
        return MiniSettings(ssh_identity_file=ssh_identity_file, timeout_s=timeout_s,
                            placement_group_timeout_s=placement_group_timeout_s, nics=nics)

    def __init__(self, settings, num_workers: Optional[int] = None,
                 num_hosts: Optional[int] = None, num_workers_per_host: int = 1,
                 cpus_per_worker: int = 1, use_gpu: bool = False,
                 gpus_per_worker: Optional[int] = None, use_current_placement_group: bool = True,
                 min_workers: Optional[int] = None, max_workers: Optional[int] = None,
                 reset_limit: Optional[int] = None, cooldown_range: Optional[List[int]] = None,
                 elastic_timeout: int = 600, override_discovery: bool = True):
        if max_workers and (not min_workers or min_workers <= 0):
            raise ValueError("max_workers needs a positive min_workers: an elastic job "
                             "is given min_workers")
        if min_workers and num_workers:
            raise ValueError("give num_workers (a fixed job) or min_workers (an elastic "
                             "one), not both")
        if gpus_per_worker and not use_gpu:
            raise ValueError("gpus_per_worker is set, but use_gpu is False")
        if use_gpu and isinstance(gpus_per_worker, int) and gpus_per_worker < 1:
            raise ValueError(f"gpus_per_worker must be >= 1: got {gpus_per_worker}")
        if min_workers is None and not num_workers and not num_hosts:
            raise ValueError("give num_workers, or num_hosts and num_workers_per_host")
        if num_workers and num_hosts:
            raise ValueError("give num_workers (placed where Ray finds room) or num_hosts "
                             "and num_workers_per_host, not both")
        if min_workers is not None and not override_discovery:
            raise ValueError("override_discovery=False: horolite's elastic jobs on Ray find "
                             "their hosts from Ray's live nodes only (a discovery of your "
                             "own is not supported); leave override_discovery=True")
        self.settings = settings
        self.num_workers, self.num_hosts = num_workers, num_hosts
        self.num_workers_per_host = num_workers_per_host
        self.cpus_per_worker, self.use_gpu = cpus_per_worker, use_gpu
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else 0
        self.use_current_placement_group = use_current_placement_group
        self.min_workers, self.max_workers = min_workers, max_workers
        self.reset_limit, self.cooldown_range = reset_limit, cooldown_range
        self.elastic_timeout, self.override_discovery = elastic_timeout, override_discovery
        settings.elastic = min_workers is not None
        self.workers: List[Any] = []  # actor handles, in rank order
        self.placed = []
        self._group, self._own_group, self._rendezvous = None, False, None
        if settings.elastic:
            from .elastic import ElasticDriver
            self._elastic = ElasticDriver(self)
        else:
            self._elastic = None

    # --- starting ---
    def common_settings(self, extra_env_vars: Optional[Dict] = None) -> Dict[str, str]:
        """What every worker is told besides its place: the driver's settings, the
        interfaces of `nics`, then `extra_env_vars`."""
        return dict(forwarded_settings(), **nic_settings(getattr(self.settings, "nics", None)),
                    **{k: str(v) for k, v in (extra_env_vars or {}).items()})

    def _bundles(self):
        unit = self._unit()
        if self.num_workers:
            return [dict(unit) for _ in range(self.num_workers)], "PACK", 1
        per = self.num_workers_per_host
        return [{k: v * per for k, v in unit.items()} for _ in range(self.num_hosts)], \
            "STRICT_SPREAD", per

    def _reserve(self):
        current = get_current_placement_group() if self.use_current_placement_group else None
        if current is not None:
            _log.info("using the placement group this driver runs in "
                      "(use_current_placement_group=False for one of its own)")
            # (its bundles are the caller's: a Tune trial's trainable holds one of them, so
            # a worker takes any with room, as Horovod's do; bundle index -1)
            count = self.num_workers or self.num_hosts * self.num_workers_per_host
            return current, False, [-1] * count
        bundles, strategy, per = self._bundles()
        group = placement_group(bundles, strategy=strategy)
        wait = self.settings.placement_group_timeout_s
        try:
            ray.get(group.ready(), timeout=wait)
        except GetTimeoutError:
            remove_placement_group(group)
            raise TimeoutError(f"Ray did not give {len(bundles)} x {bundles[0]} "
                               f"({strategy}) within {wait} s (placement_group_timeout_s): "
                               f"the cluster has {ray.cluster_resources()}") from None
        return group, True, [b for b in range(len(bundles)) for _ in range(per)]

    def _worker_options(self, group, bundle: int) -> dict:
        return dict(num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=group, placement_group_bundle_index=bundle))

    def start(self, executable_cls: type = None, executable_args: Optional[List] = None,
              executable_kwargs: Optional[Dict] = None,
              extra_env_vars: Optional[Dict] = None):
        """Start the workers (and build `executable_cls(*args, **kwargs)` in each)."""
        if self._elastic is not None:
            return self._elastic.start(executable_cls, executable_args, executable_kwargs,
                                       extra_env_vars)
        key = secrets.token_bytes(32)
        # (the rendezvous actor's process starts while the placement group is reserved)
        self._rendezvous = ray.remote(actors.Rendezvous).options(num_cpus=0).remote(key)
        try:
            self._group, self._own_group, bundles = self._reserve()
        except BaseException:
            ray.kill(self._rendezvous)
            self._rendezvous = None
            raise
        actor = ray.remote(actors.Worker)
        started = [actor.options(**self._worker_options(self._group, b)).remote()
                   for b in bundles]
        self.workers = started
        try:
            nodes, address = self._started(started)
            self.placed = place(nodes, address, key, float(self.settings.timeout_s))
            self.workers = [started[p.worker] for p in self.placed]
            common = self.common_settings(extra_env_vars)
            ray.get([w.update_env_vars.remote(dict(common, **p.env))
                     for w, p in zip(self.workers, self.placed)])
            ray.get([w.start_executable.remote(executable_cls, executable_args,
                                               executable_kwargs) for w in self.workers])
        except BaseException:  # (an executable_cls that raises, say: nothing stays held)
            self.shutdown()
            raise
        _log.info("%d workers on %d nodes: %s", len(self.workers),
                  len({p.node.node_id for p in self.placed}),
                  ", ".join(f"rank {p.rank} on {p.node.label()}" for p in self.placed))

    def _started(self, started):
        """Where each started worker runs, and the rendezvous' address: waited for at most
        placement_group_timeout_s (a worker that finds no room pends silently in Ray)."""
        wait = float(self.settings.placement_group_timeout_s)
        refs = [w.node.remote() for w in started] + [self._rendezvous.address.remote()]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait)
        if len(ready) < len(refs):
            came = sum(1 for r in refs[:-1] if r in ready)
            where = "the placement group" + (" this driver runs in" if not self._own_group
                                            else "") + f" ({self._group.bundle_specs})"
            raise TimeoutError(
                f"{came} of {len(started)} workers ({self._unit()} each) started within "
                f"{wait:g} s (placement_group_timeout_s) in {where}: Ray has "
                f"{_free()} free now")
        return ray.get(refs[:-1]), ray.get(refs[-1])

    def _unit(self) -> dict:
        unit = {"CPU": self.cpus_per_worker}
        if self.use_gpu:
            unit["GPU"] = self.gpus_per_worker
        return unit

    # --- running ---
    def execute(self, fn: Callable[[Any], Any], callbacks: Optional[List[Callable]] = None
                ) -> List[Any]:
        """`fn(executable)` on every worker; their results in rank order."""
        if self._elastic is not None:
            return self._elastic.run(lambda w: fn(w), callbacks)
        return self._listened(callbacks, lambda: self._run_remote(fn))

    def run(self, fn: Callable[..., Any], args: Optional[List] = None,
            kwargs: Optional[Dict] = None, callbacks: Optional[List[Callable]] = None
            ) -> List[Any]:
        """`fn(*args, **kwargs)` on every worker; their results in rank order."""
        args, kwargs = args or [], kwargs or {}
        if self._elastic is not None:
            return self._elastic.run(lambda w: fn(*args, **kwargs), callbacks)
        return self._listened(callbacks, lambda: self._run_remote(lambda w: fn(*args, **kwargs)))

    def run_remote(self, fn: Callable[..., Any], args: Optional[List] = None,
                   kwargs: Optional[Dict] = None) -> List[Any]:
        """As run(), without waiting: Ray ObjectRefs, in rank order."""
        if self._elastic is not None:
            raise NotImplementedError("run_remote() runs a fixed set of workers; an "
                                      "elastic job (min_workers) is run with run()")
        args, kwargs = args or [], kwargs or {}
        return self._run_remote(lambda w: fn(*args, **kwargs))

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """`fn(executable)` on rank 0's worker only."""
        return ray.get(self._live_workers()[0].execute.remote(fn))

    def _live_workers(self):
        workers = self._elastic.workers() if self._elastic is not None else self.workers
        if not workers:
            raise RuntimeError("the executor has no workers: call start() first")
        return workers

    def _run_remote(self, fn) -> List[Any]:
        return [w.execute.remote(fn) for w in self._live_workers()]

    def _listened(self, callbacks, start) -> List[Any]:
        """start()'s results, with `callbacks` fed what rank 0 logs meanwhile (ray_logger)."""
        listener = Listener(callbacks)
        workers = self._live_workers()
        if listener.queue is not None:
            ray.get([w.set_queue.remote(listener.queue) for w in workers])
        try:
            return self._gather(start(), listener)
        finally:
            if listener.queue is not None:
                try:  # (a worker that died has nothing to forget)
                    ray.get([w.set_queue.remote(None) for w in workers], timeout=10)
                except Exception as e:
                    _log.debug("forgetting the callbacks' queue: %r", e)
            listener.close()

    def _gather(self, refs: List[Any], listener: Optional[Listener] = None) -> List[Any]:
        """Every result in rank order; after a failure, the others' outcomes for at most
        timeout_s, then the failure, a dead worker's first."""
        results: List[Any] = [None] * len(refs)
        pending = {ref: rank for rank, ref in enumerate(refs)}
        died: Dict[int, BaseException] = {}
        raised: List[tuple] = []
        deadline = None
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if listener is not None and listener.queue is not None:
                listener.drain()
                left = 0.1 if left is None else min(left, 0.1)
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=left)
            if not ready:
                if deadline is None or time.monotonic() < deadline:
                    continue
                break
            rank = pending.pop(ready[0])
            try:
                results[rank] = ray.get(ready[0])
            except Exception as e:  # (Ray's own failures: the actor, its node, its memory)
                if classify(e) == RAY:
                    died[rank] = e
                else:
                    raised.append((rank, e))
            if (died or raised) and deadline is None:
                deadline = time.monotonic() + float(self.settings.timeout_s)
        if died or raised:
            busy = sorted(pending.values())
            self._settle([r for r in range(len(refs)) if r not in died and
                          r not in busy and all(r != q for q, _ in raised)])
            if busy:
                _log.warning("ranks %s had not returned %s s after the failure: their workers "
                             "run them still, and a next run() would wait for them; "
                             "shutdown() and start() again to go on", busy,
                             self.settings.timeout_s)
        raised.sort(key=lambda item: _told_by_a_peer(item[1]))  # (the cause's rank first)
        if died:
            rank, cause = min(died.items())
            where = self.placed[rank].node.label() if rank < len(self.placed) else "?"
            how = "its Ray actor ended" if isinstance(cause, RayActorError) else "Ray failed"
            text = (f"rank {rank} (host {where}) died: {how} "
                    f"({type(cause).__name__}: {_first_line(cause)})")
            if len(died) > 1:
                text += "; also " + ", ".join(f"rank {q}" for q in sorted(died) if q != rank)
            if raised:
                text += f"; rank {raised[0][0]} said: {_first_line(raised[0][1])}"
            if pending:
                text += (f"; ranks {sorted(pending.values())} had not returned "
                         f"{self.settings.timeout_s} s later")
            raise HorovodInternalError(text) from cause
        if raised:
            raise raised[0][1]
        return results

    def _settle(self, ranks: List[int]) -> None:
        """Ranks whose function returned while another's failed stop horolite too, so
        that each starts a new world at the next run() (those that raised did already)."""
        workers = self._live_workers() if self._elastic is None else []
        try:
            ray.get([workers[r].settle.remote() for r in ranks if r < len(workers)],
                    timeout=float(self.settings.timeout_s))
        except Exception as e:  # (one died meanwhile: the error raised says what failed)
            _log.debug("settling the workers after a failure: %r", e)

    def shutdown(self):
        """End the workers and the rendezvous, and give back the placement group."""
        if self._elastic is not None:
            self._elastic.shutdown()
        for handle in self.workers + ([self._rendezvous] if self._rendezvous else []):
            try:
                ray.kill(handle)
            except Exception as e:
                _log.debug("ray.kill: %r", e)
        self.workers, self._rendezvous = [], None
        if self._group is not None and self._own_group:
            try:
                remove_placement_group(self._group)
            except Exception as e:  # (Ray itself shut down first: nothing is held)
                _log.debug("remove_placement_group: %r", e)
        self._group = None


def _free() -> dict:
    """What the cluster has free, less the placement groups' own names for it."""
    return {k: v for k, v in ray.available_resources().items()
            if "_group_" not in k and not k.startswith(("node:", "memory",
                                                        "object_store_memory"))}


def _told_by_a_peer(error: BaseException) -> bool:
    """A rank's error that only says another rank failed (HorovodInternalError), not
    the failure itself (Ray's RayTaskError wraps what the function raised as `cause`)."""
    cause = getattr(error, "cause", None) if isinstance(error, RayTaskError) else error
    return isinstance(cause or error, HorovodInternalError)


def _first_line(error: BaseException, limit: int = 200) -> str:
    """A Ray error's gist: a task's last traceback line, an actor's first sentence."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    text = lines[0] if isinstance(error, RayActorError) else lines[-1]
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ..."
