"""Elastic jobs on Ray (``RayExecutor(min_workers=..., max_workers=...)``), recovering in
the running processes as ``horolite-run --gloo --min-np`` does. A driver that is a Ray
Client keeps the job's rendezvous in an actor on the cluster; any other serves it itself.

The driver is launcher/elastic_gloo.py's, with Ray in the places of processes and hosts:
a slot is room for one worker on a live Ray node (its CPUs, or GPUs, per worker, as
Horovod's Ray discovery counts them); a worker is an actor pinned to its node, running
the training function. When an actor dies, or the survivors name one that stopped
answering, it alone is evicted and the survivors form the next generation in their
running processes (hvd.elastic.run); a new actor starts in the free slot and joins at
the next commit. The training function's own error ends the job, as Ray raised it.
"""
from __future__ import annotations

import logging
import secrets
from typing import Any, Callable, Dict, List, Optional

import ray
import ray.util.client
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from horolite.launcher import gloo
from horolite.launcher.elastic_flags import ElasticConfig
from horolite.launcher.elastic_gloo import _Driver
from horolite.launcher.host_pool import Discovery
from horolite.world.generations import JOIN, TIMEOUT, WORKER

from . import actors
from .failures import RAY, USER, classify, node_failed
from .gpus import user_picks_device
from .ray_logger import Listener

__all__ = ["ElasticDriver", "RayNodes"]

_log = logging.getLogger("horolite.ray")


class RayNodes(Discovery):
    """Live Ray nodes and how many workers each has room for."""

    def __init__(self, cpus_per_worker: float, gpus_per_worker: float):
        self.cpus, self.gpus = cpus_per_worker, gpus_per_worker
        self.node_ids: Dict[str, str] = {}  # label -> Ray node id

    def find(self) -> Dict[str, int]:
        found = {}
        for node in ray.nodes():
            if not node.get("Alive"):
                continue
            have = node.get("Resources", {})
            slots = int(have.get("CPU", 0) // self.cpus) if self.cpus else 1 << 30
            if self.gpus:
                slots = min(slots, int(have.get("GPU", 0) // self.gpus))
            if slots > 0:
                label = f"{node['NodeManagerAddress']} node {node['NodeID'][:8]}"
                self.node_ids[label] = node["NodeID"]
                found[label] = slots
        return found

    def describe(self) -> str:
        return "the Ray cluster's live nodes"


class _Outcome:
    """Where the driver reads a process's end: the actor's training call."""

    def __init__(self, worker: "_RayWorker"):
        self.worker, self.returncode = worker, None
        self.result: Any = None
        self.error: Optional[BaseException] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            ready, _ = ray.wait([self.worker.ref], timeout=0)
            if ready:
                self._take()
        return self.returncode

    def _take(self) -> None:
        try:
            self.result, self.returncode = ray.get(self.worker.ref), 0
        except Exception as e:
            self.error = e
            kind = classify(e)
            # Ray's own failures end the worker as a death does: it is evicted, and its
            # actor killed (below); the runtime's are recovered from; the code's end the job.
            self.returncode = -9 if kind == RAY else 1
            if kind == USER:
                self.worker.raised(e)


class _RayWorker:
    """One worker actor, as elastic_gloo's driver sees a worker process."""

    def __init__(self, name: str, host: str, rank: int, actor, fn, on_user_error):
        self.name, self.host, self.rank, self.actor = name, host, rank, actor
        self.joining, self.evicted = False, None
        self.gpus = None  # the ObjectRef of its GPU ids (with use_gpu)
        self._on_user_error = on_user_error
        self.ref = actor.execute.remote(fn)
        self.proc = _Outcome(self)

    def raised(self, error: BaseException) -> None:
        self._on_user_error(self, error)

    def stop(self, signum: int = 0) -> None:
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception as e:
            _log.debug("ray.kill(%s): %r", self.name, e)

    def failed(self) -> bool:
        return self.proc.poll() is not None and self.proc.returncode != 0

    def how(self) -> str:
        error = self.proc.error
        if isinstance(error, RayActorError):
            return f"died: its Ray actor ended ({_gist(error)})"
        if error is not None and classify(error) == RAY:
            return f"failed in Ray: {type(error).__name__}: {_gist(error)}"
        return f"raised {type(error).__name__}" if error is not None else "ended"


def _gist(error: BaseException, limit: int = 160) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else type(error).__name__
    return text if len(text) <= limit else text[:limit] + " ..."


class _RayJob(_Driver):
    def __init__(self, executor, fn, ecfg: ElasticConfig, listener: Listener):
        self.nodes = RayNodes(executor.cpus_per_worker, executor.gpus_per_worker)
        super().__init__(None, ecfg, discovery=self.nodes)
        self.executor, self.fn, self.listener = executor, fn, listener
        self.user_error_raised: Optional[BaseException] = None

    def _user_error(self, worker, error) -> None:
        if self.user_error is None:
            self.user_error = f"{worker.name} (host {worker.host})"
            self.user_error_raised = error

    def _start(self, host: str, joining: bool, slots=None, gpus=None) -> _RayWorker:
        """A worker on `host`. With GPUs, it sees `gpus` (the ObjectRefs of its host's
        workers' GPU ids, in local-rank order; generation 0) or, joining, those of its
        host's members in rank order, then its own (where its local rank will be)."""
        index = len(self.workers)
        actor = self._actor(host) if gpus is None else gpus[index][0]
        name = f"w{index}"
        slot = slots[index] if slots else gloo.RankSlot(index, host, 0, 1, 0, 1)
        env = gloo.rank_env(slot, len(slots) if slots else 1, self.address, self.server.port,
                            float(self.executor.settings.timeout_s), self.key)
        env.update({WORKER: name, TIMEOUT: f"{self.ecfg.timeout:g}"})
        if joining:  # (its place comes with the plan that adds it)
            for prefix in ("HOROLITE_", "HOROVOD_"):
                for what in ("SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE"):
                    env.pop(prefix + what, None)
            env[JOIN] = "1"
        ex = self.executor
        actor.update_env_vars.remote(dict(self.common_env, **env))
        own = None
        if ex.gpus_per_worker:
            if gpus is not None:
                own, order = gpus[index][1], [ref for _, ref in gpus[index][2]]
            else:
                own = actor.get_gpu_ids.remote()
                order = [w.gpus for w in self.members if w.host == host] + [own]
            # (-1: its device is always named; its local rank changes with the generations,
            # and newcomers that join together each counted only the members before them)
            actor.share_gpus.remote(own, order, -1, not user_picks_device())
        if self.listener.queue is not None:
            actor.set_queue.remote(self.listener.queue)
        actor.start_executable.remote(*ex.executable)
        worker = _RayWorker(name, host, index, actor, self.fn, self._user_error)
        worker.joining, worker.gpus = joining, own
        self.workers.append(worker)
        return worker

    def _actor(self, host: str):
        ex = self.executor
        return ray.remote(actors.Worker).options(
            num_cpus=ex.cpus_per_worker, num_gpus=ex.gpus_per_worker,
            scheduling_strategy=NodeAffinitySchedulingStrategy(self.nodes.node_ids[host],
                                                               soft=False)).remote()

    def _first_actors(self, first: List[str]):
        """Generation 0's actors, each with its GPU ids' ObjectRef and its host's (in
        local-rank order), so each sees its host's GPUs before the training starts."""
        if not self.executor.gpus_per_worker:
            return None
        started = [self._actor(h) for h in first]
        refs = [a.get_gpu_ids.remote() for a in started]
        return [(a, ref, [(h2, r2) for h2, r2 in zip(first, refs) if h2 == h])
                for a, ref, h in zip(started, refs, first)]

    def _each_turn(self) -> None:
        self.listener.drain()

    def _evict(self, lost) -> None:
        """As horolite-run's driver, and the evicted workers' actors are killed (an actor
        whose call ended still holds its CPUs and GPUs); a node Ray says cannot hold a
        worker now (failures.node_failed) gets no newcomer while it cools down."""
        super()._evict(lost)
        for worker, why in lost:
            worker.stop()
            if node_failed(worker.proc.error):
                self.pool.blacklist_host(worker.host, f"{worker.name} {why}")
                _log.warning("elastic: %s (host %s) %s; no new worker starts there while it "
                             "cools down: %s", worker.name, worker.host, why,
                             self.pool.describe())

    def run(self) -> int:
        from horolite.world.rendezvous import HOSTS, RendezvousServer
        self.pool.refresh(first=True)
        self.key = secrets.token_bytes(32)
        self.common_env = self.executor.common_env
        if ray.util.client.ray.is_connected():
            # A Ray Client driver is outside the cluster: the ranks could not reach it.
            self.server = _ServedByAnActor(self.key)
            self.address = self.server.address
        else:
            self.address = ray.util.get_node_ip_address()
            self.server = RendezvousServer(self.key, host="0.0.0.0", port=0)
        try:
            first = self._first_hosts()
            self.server.put(*HOSTS, "\n".join(first).encode())
            slots = gloo.slots_for(first)
            gpus = self._first_actors(first)
            self.members = [self._start(h, joining=False, slots=slots, gpus=gpus)
                            for h in first]
            self._publish_plan(self.members)
            _log.info("elastic: generation 0: %d workers on %s", len(first),
                      ", ".join(f"{h}:{n}" for h, n in self._count(self.members).items()))
            return self._watch()
        finally:
            for worker in self.workers:  # (every actor: one that returned still holds its CPUs)
                worker.proc.poll()
                worker.stop()
            self.server.close()


class _ServedByAnActor:
    """The job's rendezvous in an actor on the cluster (as Horovod runs its elastic driver
    in one under Ray Client), with the RendezvousServer methods the driver calls."""

    def __init__(self, key: bytes):
        self.actor = ray.remote(actors.Rendezvous).options(num_cpus=0).remote(key)
        self.address, self.port = ray.get(self.actor.address.remote())

    def put(self, scope: str, key: str, value: bytes) -> None:
        ray.get(self.actor.put.remote(scope, key, value))

    def items(self, scope: str) -> Dict[str, bytes]:
        return ray.get(self.actor.items.remote(scope))

    def close(self) -> None:
        try:
            ray.kill(self.actor)
        except Exception as e:
            _log.debug("ray.kill(the rendezvous): %r", e)


class ElasticDriver:
    """RayExecutor's side of an elastic job: start() keeps what the workers get, run()
    runs one job to its end and returns the last generation's results in rank order."""

    def __init__(self, executor):
        if not executor.min_workers or executor.min_workers < 1:
            raise ValueError("min_workers must be at least 1")
        if executor.max_workers is not None and executor.max_workers < executor.min_workers:
            raise ValueError(f"max_workers {executor.max_workers} is below min_workers "
                             f"{executor.min_workers}")
        self.executor = executor
        self.ecfg = ElasticConfig(
            num_proc=executor.min_workers, min_np=executor.min_workers,
            max_np=executor.max_workers, timeout=float(executor.elastic_timeout),
            reset_limit=executor.reset_limit,
            cooldown=tuple(executor.cooldown_range) if executor.cooldown_range else None,
            script=None, slots_per_host=None)
        self.started = False

    def start(self, executable_cls, executable_args, executable_kwargs, extra_env_vars):
        ex = self.executor
        ex.executable = (executable_cls, executable_args, executable_kwargs)
        ex.common_env = ex.common_settings(extra_env_vars)
        self.started = True

    def run(self, fn: Callable[[Any], Any], callbacks=None) -> List[Any]:
        if not self.started:
            raise RuntimeError("call start() before run()")
        listener = Listener(callbacks)
        job = _RayJob(self.executor, fn, self.ecfg, listener)
        try:
            code = job.run()
        except (RuntimeError, ValueError) as e:  # (too few slots at the start)
            raise RuntimeError(f"the elastic job could not start: {e}") from None
        finally:
            listener.close()
        if job.user_error_raised is not None:
            raise job.user_error_raised
        if code != 0:
            raise RuntimeError(f"the elastic job failed (see the log): "
                               f"{job.pool.describe()}")
        return [w.proc.result for w in job.members]

    def workers(self):
        raise NotImplementedError("elastic mode has no fixed workers: use run() or execute()")

    def shutdown(self) -> None:
        self.started = False
