"""``horolite-run --gloo --min-np N``: elastic training whose survivors never restart.

Without MPI the world is horolite's own, so it can change under running processes.
This driver serves the job's rendezvous for the job's whole life and numbers its
worlds ("generations"), each a plan of workers in rank order put at the rendezvous
(horolite/elastic/in_process.py is the ranks' side):

- **A worker fails** (its process ends with an error, or the survivors name it at the
  rendezvous as the rank that stopped answering): it alone is evicted, not its host
  (horovod#1965), and the next plan is the survivors in their old order, so rank 0 is
  the oldest survivor, from which every rank syncs its state. The survivors' step
  failed; they form the new world in their running processes.
- **A slot is free** (a failed worker's, or a host the discovery script added): a
  worker is started there. It imports and builds while the others train, says at the
  rendezvous that it is ready, and the next plan adds it; the others move to that plan
  at their next commit (HostsUpdatedInterrupt) and it receives the state by broadcast.
- **A host is gone** from discovery: the next plan leaves its workers out; they end at
  the others' next commit.

A worker that ends before it joined blacklists its host for new workers (for good, or as
--blacklist-cooldown-range says); the workers already there stay. The job ends when
every worker has
ended: 0 when the last ones ended well; 1 when the training code raised (it is not
retried), when fewer than --min-np workers are left, when no worker left holds the
training state, or past --reset-limit. What counts as a failure, and whom it evicts, is
elastic_policy.py's.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional, Tuple

from . import gloo
from . import hosts as hostlib
from .elastic_workers import Worker, free_slot, plan_for
from .elastic_policy import FailurePolicy, _log
from .host_pool import DiscoveryScript, FixedHosts, HostPool, assign
# What the ranks read (the worker's name, joining, the wait for a world) and the rendezvous
# scope of the plans, the blame and the newcomers: the ranks' side defines them.
from horolite.world.generations import JOIN, SCOPE, SLOT, TIMEOUT, WORKER

__all__ = ["run_elastic_gloo", "stall_shutdown_default"]
POLL_SECONDS = 0.02
DISCOVERY_SECONDS = 1.0  # Horovod asks its discovery script about once a second
STOP_SECONDS = 5.0  # how long workers have to end at the job's end (SIGTERM, then SIGKILL)
# A rank that hangs (stopped, a deadlock, a host cut off) is named by the others after
# this long inside a collective, and evicted, unless the job sets its own stall shutdown.
STALL_SHUTDOWN_SECONDS = 60.0
_STALL_SHUTDOWN = ("HOROLITE_STALL_SHUTDOWN_TIME_SECONDS", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS")


def stall_shutdown_default(env: Dict[str, str], environ: Dict[str, str]) -> None:
    """Give a worker's environment `env` the elastic default stall shutdown, unless the
    job's environment or horolite-run's flags set one (0 keeps Horovod's: no shutdown)."""
    if not any(name in env or name in environ for name in _STALL_SHUTDOWN):
        env[_STALL_SHUTDOWN[0]] = f"{STALL_SHUTDOWN_SECONDS:g}"


class _Driver(FailurePolicy):
    def __init__(self, config, ecfg, discovery=None):
        self.config, self.ecfg = config, ecfg
        if discovery is None and ecfg.script:
            discovery = DiscoveryScript(ecfg.script, ecfg.slots_per_host)
        elif discovery is None:
            hosts = config.hosts or (("localhost", ecfg.num_proc),)
            discovery = FixedHosts(hosts, ",".join(f"{h}:{n}" for h, n in hosts))
        self.pool = HostPool(discovery, ecfg.cooldown)
        self.workers: List[Worker] = []
        self.members: List[Worker] = []  # the current generation's, in rank order
        self.user_errors: List[Tuple[Worker, str]] = []  # (worker, what it said it raised)
        self.user_error: Optional[str] = None  # (one a subclass found itself: the job ends)
        self.generation, self.resets = 0, 0
        self.stopping: Optional[int] = None
        self.changed = False  # members were evicted since the last plan
        self.blamed_at: Dict[Tuple[int, Worker], float] = {}  # (generation, worker): when
        self.plans: Dict[int, List[str]] = {}  # each generation's workers in rank order
        self.decided: set = set()  # generations in which a blame evicted someone
        self.arriving: Optional[Tuple[int, float]] = None  # (generation, since) while forming
        self.said: List[str] = []  # why, for the next plan's log line
        self.holders: set = set()  # workers that hold the training state (synced once)
        self.failures_in_a_row, self.last_commit = 0, b""

    # --- starting workers ---
    def _address(self, host: str) -> str:
        if host not in self.addresses:
            self.addresses.update(gloo.rendezvous_addresses(
                [host], self.config.network_interface)[1])
        return self.addresses[host]

    def _start(self, host: str, joining: bool, slots=None) -> Worker:
        """A worker on `host`: as rank len(workers) of `slots` (generation 0), or to join."""
        index = len(self.workers)
        name = f"w{index}"
        slots = slots or [gloo.RankSlot(index, host, 0, 1, 0, 1)]
        spec = gloo.build_plan(self.config, slots, {s.host: self._address(s.host) for s in slots},
                               self.server.port, self.key, self.environ, self.cwd)["ranks"]
        spec = spec[index] if len(spec) > 1 else spec[0]
        spec["env"].update({WORKER: name, TIMEOUT: f"{self.ecfg.timeout:g}"})
        if not joining:  # (a new worker learns its slot from the plan that adds it)
            spec["env"][SLOT] = str(slots[index].local_rank)
        stall_shutdown_default(spec["env"], self.environ)
        if joining:  # (its place comes with the plan that adds it; the prefix is its number)
            for prefix in ("HOROLITE_", "HOROVOD_"):
                for what in ("SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE"):
                    spec["env"].pop(prefix + what, None)
            spec["env"][JOIN] = "1"
        slot = slots[index].local_rank if not joining else self._free_slot(host)
        worker = Worker(name, spec, self.cwd, self._on_marker)
        worker.joining, worker.slot = joining, slot
        self.workers.append(worker)
        return worker

    def _free_slot(self, host: str) -> int:
        """The local rank a new worker on `host` takes: the lowest that no member or
        other new worker there holds (a failed worker's), so that survivors keep theirs."""
        return free_slot([w.slot for w in self.members + self._pending()
                          if w.host == host and getattr(w, "slot", None) is not None])

    def _on_marker(self, worker: Worker, kind: str, fields: dict) -> None:
        if kind == "elastic" and fields.get("event") == "user-error":
            self.user_errors.append((worker, fields.get("text", "it raised")))

    def _wanted(self, blacklisted_too: bool = False) -> Dict[str, int]:
        """Slots per host to fill (up to --max-np), in the pool's order."""
        hosts = [(h, self.pool.slots[h]) for h in self.pool.order] if blacklisted_too \
            else self.pool.available()
        return dict(assign(hosts, self.ecfg.max_np))

    def _first_hosts(self) -> List[str]:
        deadline = time.monotonic() + self.ecfg.timeout
        while True:
            wanted = self._wanted()
            if sum(wanted.values()) >= self.ecfg.num_proc:
                return [h for h, n in wanted.items() for _ in range(n)]
            if not self.pool.can_change() or time.monotonic() >= deadline:
                raise RuntimeError(f"need {self.ecfg.num_proc} slots: {self.pool.describe()}")
            time.sleep(DISCOVERY_SECONDS)
            self.pool.refresh()

    # --- the job ---
    def run(self) -> int:
        from horolite.world.rendezvous import HOSTS, RendezvousServer
        self.pool.refresh(first=True)
        self.key, self.environ, self.cwd = secrets.token_bytes(32), dict(os.environ), os.getcwd()
        first = self._first_hosts()
        remote = self.ecfg.script or any(not hostlib.is_local(h) for h in first)
        self.bind = "0.0.0.0" if remote else "127.0.0.1"
        self.addresses: Dict[str, str] = {}
        self.server = RendezvousServer(self.key, host=self.bind, port=0)
        self.server.put(*HOSTS, "\n".join(first).encode())
        previous = {sig: signal.signal(sig, self._on_signal)
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            slots = gloo.slots_for(first)
            self.members = [self._start(h, joining=False, slots=slots) for h in first]
            self._publish_plan(self.members)
            _log(f"generation 0: {len(first)} ranks on "
                 f"{', '.join(f'{h}:{n}' for h, n in self._count(self.members).items())}")
            return self._watch()
        finally:
            for worker in self.workers:
                worker.stop(signal.SIGTERM)
            deadline = time.monotonic() + STOP_SECONDS
            for worker in self.workers:
                try:
                    worker.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    worker.proc.kill()  # (an ssh to a host cut off: its wrapper ends alone)
                    worker.proc.wait()
            for worker in self.workers:
                worker.join_relays(max(0.1, deadline + 1 - time.monotonic()))
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.server.close()

    def _on_signal(self, signum, frame) -> None:
        self.stopping = signum

    @staticmethod
    def _count(workers) -> Dict[str, int]:
        found: Dict[str, int] = {}
        for w in workers:
            found[w.host] = found.get(w.host, 0) + 1
        return found

    def _publish_plan(self, workers) -> None:
        slots = {w.name: getattr(w, "slot", None) for w in workers}
        plan = plan_for(self.generation, [w.name for w in workers],
                        {w.name: w.host for w in workers},
                        None if None in slots.values() else slots)
        self.server.put(SCOPE, f"plan.{self.generation}", json.dumps(plan).encode())
        self.server.put(SCOPE, "latest", str(self.generation).encode())
        self.ranked = list(workers)  # (what a blame's rank numbers mean)
        self.plans[self.generation] = [w.name for w in workers]
        if self.generation == 0:
            self.holders = set(workers)  # (the initial state, whatever they do first)
        for rank, w in enumerate(workers):
            w.rank = rank

    def _said(self, prefix: str) -> Dict[str, str]:
        """{worker name: value} of the rendezvous keys `<prefix>.<name>`."""
        return {key[len(prefix) + 1:]: value.decode() for key, value in
                self.server.items(SCOPE).items() if key.startswith(prefix + ".")}

    def _watch(self) -> int:
        next_discovery = time.monotonic() + DISCOVERY_SECONDS
        short_since = None  # when fewer than --min-np survivors were left
        while True:
            self._each_turn()
            if self.stopping is not None:
                _log(f"stopped by {signal.Signals(self.stopping).name}")
                return 128 + self.stopping
            blamed = self._blamed()
            user_error = self._training_code_error(blamed)
            if user_error is not None:
                _log(f"the training code raised on {user_error}: an elastic job is not "
                     "retried for an error of its own")
                return 1
            lost = [(w, w.how()) for w in self.members if w.failed()]
            for worker, why in self._hung(blamed, lost) + [
                    (w, why) for w, why in self._late() if not any(w is v for v, _ in lost)]:
                worker.stop(signal.SIGTERM)  # (a rank that hangs: its wrapper SIGKILLs it)
                lost.append((worker, why))
            if lost:
                self._evict(lost)
                code = self._state_lost()
                if code is not None:
                    return code
            self._newcomers_that_failed()
            if time.monotonic() >= next_discovery:
                next_discovery = time.monotonic() + DISCOVERY_SECONDS
                self.pool.refresh()
            leaving = self._leaving()
            ready = [w for w in self._pending() if w.name in self._said("ready")]
            if self.changed or leaving or ready:
                if len(self.members) - len(leaving) + len(ready) >= self.ecfg.min_np:
                    short_since = None
                    code = self._next_generation(leaving, ready)
                    if code is not None:
                        return code
                else:
                    if short_since is None:
                        short_since = time.monotonic()
                        _log(f"{len(self.members)} rank(s) left, fewer than --min-np "
                             f"{self.ecfg.min_np}: waiting up to --elastic-timeout "
                             f"{self.ecfg.timeout:g} s for new ones; {self.pool.describe()}")
                    self._fill_free_slots(short=True)
                    if time.monotonic() - short_since > self.ecfg.timeout or \
                            not (self._pending() or self.pool.can_change()):
                        _log(f"{len(self.members)} rank(s) left, fewer than --min-np "
                             f"{self.ecfg.min_np}, and no more can come in time: the job "
                             f"fails; {self.pool.describe()}")
                        return 1
            elif self.members and all(w.proc.poll() is not None for w in self.members):
                return 0 if all(w.proc.returncode == 0 for w in self.members) else 1
            if any(w.proc.returncode == 0 for w in self.members):
                self._finishing()
            else:
                self._fill_free_slots()
            time.sleep(POLL_SECONDS)

    def _each_turn(self) -> None:
        """Once per turn of the watch (a driver on Ray feeds its callbacks here)."""

    def _finishing(self) -> None:
        """A member ended well: training is over. Workers that never entered a world
        (started to join, or planned in but never met) can only wait: they are stopped."""
        entered = self._said("entered")
        for w in list(self.members) + self._pending():
            if w.joining and w.name not in entered and w.proc.poll() is None:
                w.stop(signal.SIGTERM)
                w.evicted = "was stopped: training ended before it joined"
                if w in self.members:
                    self.members.remove(w)
                _log(f"{w.name} (host {w.host}) {w.evicted}")

    def _evict(self, lost) -> None:
        for worker, why in lost:
            worker.evicted = why
            self.said.append(f"rank {worker.rank} ({worker.name}, host {worker.host}) {why}")
        self.members = [w for w in self.members if w.evicted is None]
        self.changed = True

    def _leaving(self) -> List[Worker]:
        """Members beyond what their host still offers (the newest go first)."""
        wanted, leaving = self._wanted(blacklisted_too=True), []
        for host, count in self._count(self.members).items():
            extra = count - wanted.get(host, 0)
            if extra > 0:
                leaving += [w for w in self.members if w.host == host][-extra:]
        return leaving

    def _pending(self) -> List[Worker]:
        """Workers started to join that have not yet been put in a plan."""
        return [w for w in self.workers if w.joining and w.evicted is None
                and w not in self.members and w.proc.poll() is None]

    def _newcomers_that_failed(self) -> None:
        """Workers that ended before they joined (could not start, or left at once): their
        host is blacklisted for new workers; its members stay (see _leaving)."""
        for w in self.workers:
            if w.joining and w.evicted is None and w not in self.members and \
                    w.proc.poll() is not None:
                w.evicted = w.how()
                self.pool.blacklist_host(w.host, f"{w.name} {w.evicted} before it joined")
                _log(f"{w.name} (host {w.host}) {w.evicted} before it joined; no new worker "
                     f"starts there while it is blacklisted: {self.pool.describe()}")

    def _fill_free_slots(self, short: bool = False) -> None:
        """Start workers in the slots nobody holds, once the current generation has formed
        (a new process's start would slow the survivors' recovery on a busy host), or at
        once when too few are left to form one (`short`)."""
        entered = self._said("entered")
        if not short and self.changed or (not short and self.generation and any(
                int(entered.get(w.name, -1)) < self.generation for w in self.members)):
            return
        placed = self._count(self.members + self._pending())
        for host, slots in self._wanted().items():
            for _ in range(slots - placed.get(host, 0)):
                worker = self._start(host, joining=True)
                _log(f"{worker.name} starts on {host}, to join at the next commit")

    def _next_generation(self, leaving, ready) -> Optional[int]:
        failed = self.changed
        said = self.said + [f"rank {w.rank} ({w.name}) leaves: host {w.host} offers fewer "
                            "slots" for w in leaving] + \
            [f"{w.name} (host {w.host}) joins" for w in ready]
        self.said, self.changed = [], False
        self.resets += 1
        repeated = self._progress(failed)
        if repeated is not None:
            _log(f"generation {self.generation}: {'; '.join(said)}; {repeated}: the job fails")
            return 1
        if self.ecfg.reset_limit is not None and self.resets > self.ecfg.reset_limit:
            _log(f"generation {self.generation}: {'; '.join(said)}; that is reset "
                 f"{self.resets}, more than --reset-limit {self.ecfg.reset_limit}: the job fails")
            return 1
        self.generation += 1
        for w in leaving:  # (it ends when it reads the plan: never a newcomer again)
            w.evicted = "left: its host offers fewer slots"
        self.members = [w for w in self.members if w not in leaving] + ready
        self._publish_plan(self.members)
        _log(f"generation {self.generation - 1}: {'; '.join(said)}; generation "
             f"{self.generation}: {len(self.members)} rank(s)" +
             (" go on in their running processes" if failed else ", from the next commit"))
        return None


def run_elastic_gloo(config, ecfg) -> int:
    """horolite-run's main() for `--gloo` with `--min-np` or `--host-discovery-script`."""
    try:
        return _Driver(config, ecfg).run()
    except (RuntimeError, ValueError) as e:  # (the pool's first answer; too few slots)
        _log(f"the job fails: {e}")
        return 1
