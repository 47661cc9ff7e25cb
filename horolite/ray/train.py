"""A Ray Train backend: ``DataParallelTrainer(..., backend_config=HorovodConfig())``.

Ray Train starts the workers and runs the training loop; this backend, before the loop
starts, gives each worker its place in a horolite job (layout.py: ranks in Ray Train's
world-rank order, hosts by machine) and a rendezvous actor to meet at. The loop calls
``hvd.init()`` and uses Ray Train's own reporting and checkpoints. Works under Ray
Train V2 (the default) and V1, through Ray's BackendConfig/Backend developer API.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import secrets
from typing import Dict, Optional, Set

import ray
from ray.train.backend import Backend, BackendConfig

from . import actors
from .layout import forwarded_settings, nic_settings, place

__all__ = ["HorovodConfig"]

_log = logging.getLogger("horolite.ray")


@dataclasses.dataclass
class HorovodConfig(BackendConfig):
    """Ray Train's (former) HorovodConfig's fields, in its order. Used here: ``nics``
    (the interfaces the ranks connect on) and ``timeout_s`` (how long they wait for each
    other at init()). Accepted for code written for it, with nothing to do: ``verbose``,
    ``key`` (each run makes a key of its own), the ssh fields (Ray starts the workers)
    and ``placement_group_timeout_s`` (Ray Train places the workers)."""
    nics: Optional[Set[str]] = None
    verbose: int = 1
    key: Optional[str] = dataclasses.field(default=None, repr=False)
    ssh_port: Optional[int] = None
    ssh_identity_file: Optional[str] = None
    ssh_str: Optional[str] = None
    timeout_s: int = 300
    placement_group_timeout_s: int = 100

    @property
    def backend_cls(self):
        return _HorovodBackend

    def to_dict(self):
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "key"}


def _set_env(env: Dict[str, str]) -> None:
    os.environ.update(env)


def _shutdown_horolite() -> None:
    import horolite
    if horolite.is_initialized():
        horolite.shutdown()


class _HorovodBackend(Backend):
    def on_start(self, worker_group, backend_config: HorovodConfig):
        nodes = worker_group.execute(actors.node_info)
        key = secrets.token_bytes(32)
        self._rendezvous = ray.remote(actors.Rendezvous).options(num_cpus=0).remote(key)
        address = ray.get(self._rendezvous.address.remote())
        placed = place(nodes, address, key, float(backend_config.timeout_s), keep_order=True)
        common = dict(forwarded_settings(), **nic_settings(backend_config.nics))
        ray.get([worker_group.execute_single_async(p.rank, _set_env, dict(common, **p.env))
                 for p in placed])

    def on_shutdown(self, worker_group, backend_config: HorovodConfig):
        try:
            worker_group.execute(_shutdown_horolite)
        except Exception as e:  # (workers already gone: nothing of horolite is left there)
            _log.debug("shutdown on the workers: %r", e)
        rendezvous = getattr(self, "_rendezvous", None)
        if rendezvous is not None:
            ray.kill(rendezvous)
            self._rendezvous = None

