"""The generations of an elastic job's world without MPI, as horolite-run announces them.

Under ``horolite-run --gloo --min-np N`` (launcher/elastic_gloo.py) the launcher keeps
the rendezvous for the job's whole life and puts a plan there for each generation of
the world: which workers, in which rank order, on which hosts (scope "elastic", keys
``plan.<n>`` and ``latest``). Each worker has a name for the job's life
(HOROLITE_ELASTIC_WORKER). A rank moves to a newer generation after a failure or at a
commit (horolite/elastic/in_process.py); a worker started later (HOROLITE_ELASTIC_JOIN)
enters its first one from init(). Either way: wait for a plan newer than the last one
seen, find this worker in it, and meet its ranks, giving up on a generation as soon as
a newer one is announced (a rank of it died before it formed).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from typing import Callable, List, Mapping, Optional

__all__ = ["SCOPE", "WORKER", "JOIN", "TIMEOUT", "JOIN_WAIT_SECONDS", "current", "worker",
           "joining", "LeftOut", "waited_for", "blame", "enter_next", "join"]

_log = logging.getLogger("horolite.world")

SCOPE = "elastic"
WORKER = "HOROLITE_ELASTIC_WORKER"
JOIN = "HOROLITE_ELASTIC_JOIN"
TIMEOUT = "HOROLITE_ELASTIC_TIMEOUT"
_current = 0


class LeftOut(Exception):
    """The newest plan does not hold this worker (its host is gone, or it was evicted)."""


def current() -> int:
    """The generation this process's world belongs to (0: the first, or not elastic)."""
    return _current


def worker(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    return environ.get(WORKER) or None


def joining(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this worker was started after the job's first world, to join one."""
    return bool(worker(environ)) and bool(environ.get(JOIN))


def wait_seconds(environ: Mapping[str, str] = os.environ) -> float:
    return float(environ.get(TIMEOUT, "") or 600.0)


# A new worker waits for the others to arrive at their next commit however far off it is:
# while it stays alive the launcher keeps its place, and evicts whoever does not come.
JOIN_WAIT_SECONDS = 1e7


def client(found, environ: Mapping[str, str] = os.environ):
    from . import gloo_timeout
    from .identity import job_key
    from .rendezvous import RendezvousClient
    return RendezvousClient(found.rendezvous_addr, found.rendezvous_port, job_key(environ),
                            gloo_timeout(environ))


def latest(c) -> int:
    return int(c.get(SCOPE, "latest", timeout=0))


def _place(plan: dict, me: str, base):
    for entry in plan["ranks"]:
        if entry["worker"] == me:
            return dataclasses.replace(
                base, rank=entry["rank"], size=plan["size"], local_rank=entry["local_rank"],
                local_size=entry["local_size"], host_label=entry["host"],
                source=f"horolite-run --gloo, elastic generation {plan['generation']}"), entry
    return None, None


SLOT = "HOROLITE_ELASTIC_SLOT"  # set: this worker's local rank is its slot for life


def _export(entry: dict, size: int, environ) -> None:
    """The new world's numbers where the job's code (and Horovod's) reads them."""
    if entry.get("slot"):  # (horolite-run's plans keep each worker's slot)
        environ[SLOT] = str(entry["local_rank"])
    for prefix in ("HOROLITE_", "HOROVOD_"):
        environ.update({f"{prefix}RANK": str(entry["rank"]), f"{prefix}SIZE": str(size),
                        f"{prefix}LOCAL_RANK": str(entry["local_rank"]),
                        f"{prefix}LOCAL_SIZE": str(entry["local_size"]),
                        f"{prefix}CROSS_RANK": str(entry["cross_rank"]),
                        f"{prefix}CROSS_SIZE": str(entry["cross_size"])})


def waited_for(error: BaseException, rank: int) -> List[int]:
    """The ranks a world's formation waited for in vain, as its error names them
    ("rank 3 (host h)": the rendezvous, the dial and the accept all say so)."""
    found = getattr(error, "ranks", None) or \
        [int(q) for q in re.findall(r"\brank (\d+) \(host ", str(error))]
    return sorted({int(q) for q in found} - {rank})


def blame(c, generation: int, ranks: List[int], environ=os.environ) -> None:
    """Say at the rendezvous which ranks of `generation` this worker lost or waited for
    in vain (none: it only heard of a failure, or leaves for a newer world)."""
    c.put(SCOPE, f"blame.{generation}.{worker(environ)}", ",".join(map(str, ranks)).encode())


def enter_next(c, base, after: int, open_world: Callable, skip_plans_without_me: bool,
               environ=os.environ) -> int:
    """Meet the ranks of the first generation after `after` that holds this worker, with
    `open_world(identity, generation, superseded)`; returns its number. LeftOut when the
    newest plan leaves this worker out (unless `skip_plans_without_me`)."""
    global _current
    from .rendezvous import RendezvousError
    from .sockets import Superseded
    me, wait = worker(environ), wait_seconds(environ)
    while True:
        c.get(SCOPE, f"plan.{after + 1}", timeout=wait)
        newest = latest(c)
        plan = json.loads(c.get(SCOPE, f"plan.{newest}", timeout=0))
        found, entry = _place(plan, me, base)
        if found is None:
            if not skip_plans_without_me:
                raise LeftOut(f"{me} is not in generation {newest} of the job")
            after = newest
            continue

        def superseded(c2, newest=newest):
            return latest(c2) > newest
        try:
            open_world(found, newest, superseded)
        except (Superseded, TimeoutError, RendezvousError, OSError) as e:
            _log.warning("%s: generation %d did not form (%s); waiting for the next", me,
                         newest, e)
            if not isinstance(e, Superseded):  # (the launcher evicts whom it waited for)
                blame(c, newest, waited_for(e, found.rank), environ)
            after = newest
            continue
        _current = newest
        _export(entry, plan["size"], environ)
        return newest


def join(environ, open_world: Callable):
    """A worker started after the job's first world: say it is ready, then enter the first
    generation that holds it (the others move there at their next commit)."""
    from .identity import Identity
    base = Identity(rank=0, size=1, local_rank=0, local_size=1,
                    rendezvous_addr=environ["HOROLITE_RENDEZVOUS_ADDR"],
                    rendezvous_port=int(environ["HOROLITE_RENDEZVOUS_PORT"]),
                    source="horolite-run --gloo, joining", serve=False,
                    host_label=environ.get("HOROLITE_HOSTNAME"))
    c = client(base, environ)
    try:
        seen = latest(c)  # (before saying it is ready: the plan that adds it comes after)
        c.put(SCOPE, f"ready.{worker(environ)}", b"1")
        entered = enter_next(c, base, seen, open_world, True, environ)
        c.put(SCOPE, f"entered.{worker(environ)}", str(entered).encode())
        return entered
    finally:
        c.close()
