"""Recovery inside the running processes, for elastic jobs without MPI.

Under ``horolite-run --gloo --min-np N`` the launcher keeps the job's rendezvous and
numbers its worlds (launcher/elastic_gloo.py). When a rank's step fails because the
job lost a rank, the survivor:

1. says at the rendezvous whom it blames (the rank its error names), so that a rank
   that hangs rather than dies is evicted too;
2. shuts its runtime down and closes this world's connections;
3. reads the next generation's plan (which survivors, in which order), meets the other
   survivors there and connects to them under that generation's own key, so a rank of
   an older world can never join (world/sockets.py, generation_key);
4. starts the runtime again: same process, same imports, same traced functions.

Another failure while a world forms (a survivor that dies before it arrives) makes
the launcher announce a newer generation, and the ranks waiting for the old one go
straight to it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Optional

from ..core import mpi_library
from .session import log

__all__ = ["enabled", "rejoin", "WORKER"]

WORKER = "HOROLITE_ELASTIC_WORKER"  # launcher/elastic_gloo.py sets it: this worker's name
TIMEOUT = "HOROLITE_ELASTIC_TIMEOUT"
SCOPE = "elastic"
_generation = 0


def enabled() -> bool:
    """Whether this rank recovers in its running process (a --gloo elastic job)."""
    return bool(os.environ.get(WORKER)) and mpi_library.without_mpi()


def generation() -> int:
    return _generation


def _client():
    from ..world import gloo_timeout, identity_used
    from ..world.identity import job_key
    from ..world.rendezvous import RendezvousClient
    found = identity_used()
    return RendezvousClient(found.rendezvous_addr, found.rendezvous_port,
                            job_key(os.environ), gloo_timeout())


def _blamed(error: BaseException) -> Optional[int]:
    peer = getattr(error, "horolite_peer", None)
    if peer is None:
        from ..api import basics
        rt = basics._current_runtime()
        doomed = getattr(rt, "doomed", None) if rt is not None else None
        peer = getattr(doomed, "horolite_peer", None)
    return peer


def _latest(client) -> int:
    return int(client.get(SCOPE, "latest", timeout=0))


def _identity_in(plan: dict, me: str, previous):
    for entry in plan["ranks"]:
        if entry["worker"] == me:
            return dataclasses.replace(
                previous, rank=entry["rank"], size=plan["size"],
                local_rank=entry["local_rank"], local_size=entry["local_size"],
                source=f"horolite-run --gloo, elastic generation {plan['generation']}",
                host_label=entry["host"]), entry
    return None, None


def _export(entry: dict, size: int) -> None:
    """The new world's numbers where the job's code (and Horovod's) reads them."""
    for prefix in ("HOROLITE_", "HOROVOD_"):
        os.environ.update({f"{prefix}RANK": str(entry["rank"]), f"{prefix}SIZE": str(size),
                           f"{prefix}LOCAL_RANK": str(entry["local_rank"]),
                           f"{prefix}LOCAL_SIZE": str(entry["local_size"]),
                           f"{prefix}CROSS_RANK": str(entry["cross_rank"]),
                           f"{prefix}CROSS_SIZE": str(entry["cross_size"])})


def rejoin(error: BaseException) -> int:
    """Leave this world after `error` (a runtime failure) and join the next generation's;
    returns its number. SystemExit when the launcher left this worker out."""
    global _generation
    from .. import world
    from ..api import basics
    from ..world.sockets import Superseded
    from ..world.rendezvous import RendezvousError
    started = time.perf_counter()
    me = os.environ[WORKER]
    wait = float(os.environ.get(TIMEOUT, "600") or 600)
    client = _client()
    try:
        peer = _blamed(error)
        client.put(SCOPE, f"blame.{_generation}.{me}", b"" if peer is None else str(peer).encode())
        basics.shutdown()
        previous = world.identity_used()
        after = _generation
        while True:
            client.get(SCOPE, f"plan.{after + 1}", timeout=wait)
            newest = _latest(client)
            plan = json.loads(client.get(SCOPE, f"plan.{newest}", timeout=0))
            found, entry = _identity_in(plan, me, previous)
            if found is None:
                log.error("%s: left out of generation %d of the job; ending", me, newest)
                raise SystemExit(1)

            def superseded(c, newest=newest):
                return _latest(c) > newest
            try:
                world.reopen(found, newest, superseded)
            except (Superseded, TimeoutError, RendezvousError, OSError) as e:
                log.warning("%s: generation %d did not form (%s); waiting for the next",
                            me, newest, e)
                after = newest
                continue
            break
    finally:
        client.close()
    _generation = newest
    _export(entry, plan["size"])
    basics.init()
    log.info("rank %d of %d: generation %d formed in %.2f s after the failure (%s)",
             found.rank, found.size, newest, time.perf_counter() - started, error)
    return newest
