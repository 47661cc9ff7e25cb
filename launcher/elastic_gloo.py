"""``horolite-run --gloo --min-np N``: elastic training whose survivors never restart.

Without MPI the world is horolite's own, so it can change under running processes.
This driver serves the job's rendezvous for the job's whole life and numbers its
worlds ("generations"): it starts -np workers as generation 0, and when a worker's
process ends with a failure, or the survivors name one that stopped answering (they
put whom they blame at the rendezvous), it evicts that worker (that rank alone, not its
host: horovod#1965) and puts the next generation's plan at the rendezvous. The
survivors, whose step failed, read it and form the new world in their running
processes (horolite/elastic/in_process.py): nothing is started, imported or traced
again. A worker's rank in a new world keeps the order of the last one, so rank 0 is
the oldest survivor, from which every rank syncs its state.

The job ends when every worker has ended: 0 when the last ones ended well; with the
error when the training code raised (it is not retried), when fewer than --min-np
workers are left, or past --reset-limit. Standard library only, like the rest of the
launcher.
"""
from __future__ import annotations

import dataclasses
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional

from . import gloo
from .markers import marker_line, parse_marker

__all__ = ["run_elastic_gloo", "plan_for", "WORKER", "GENERATION_TIMEOUT"]

WORKER = "HOROLITE_ELASTIC_WORKER"  # a worker's name for the whole job ("w0", "w1", ...)
GENERATION_TIMEOUT = "HOROLITE_ELASTIC_TIMEOUT"  # how long a survivor waits for a new world
SCOPE = "elastic"  # the rendezvous scope of the plans and the survivors' blame
POLL_SECONDS = 0.02


def _log(message: str) -> None:
    print(f"horolite-run: elastic: {message}", file=sys.stderr, flush=True)


def plan_for(generation: int, workers: List[str], hosts: Dict[str, str]) -> dict:
    """Generation `generation`'s world: `workers` in rank order, each placed as
    gloo.layout places ranks (local and cross ranks from the hosts)."""
    slots = gloo.slots_for([hosts[w] for w in workers])
    return {"generation": generation, "size": len(workers),
            "ranks": [dict(dataclasses.asdict(slot), worker=w)
                      for w, slot in zip(workers, slots)]}


class _Worker:
    """One started process (its rank wrapper, or the ssh to it) and its output relays."""

    def __init__(self, name: str, spec: dict, cwd: str, on_marker):
        self.name, self.host, self.rank = name, spec["host"], spec["rank"]
        self.remote = spec["remote"]
        env = None if self.remote else dict(os.environ, **spec["env"])
        self.proc = subprocess.Popen(spec["argv"], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE,
                                     stdin=subprocess.PIPE if self.remote else subprocess.DEVNULL)
        self.evicted: Optional[str] = None  # why, once evicted
        self.relays = [threading.Thread(target=self._relay, args=(pipe, out, on_marker),
                                        daemon=True)
                       for pipe, out in ((self.proc.stdout, 1), (self.proc.stderr, 2))]
        for relay in self.relays:
            relay.start()
        if self.remote:
            self.tell(json.dumps({"env": spec["env"], "cwd": cwd}))

    def tell(self, line: str) -> None:
        try:
            self.proc.stdin.write(line.encode() + b"\n")
            self.proc.stdin.flush()
        except (OSError, ValueError):
            pass

    def _relay(self, pipe, out: int, on_marker) -> None:
        for line in iter(pipe.readline, b""):
            marker = marker_line(line)
            if marker is not None:
                parsed = parse_marker(marker.decode("utf-8", "replace"))
                if parsed is not None:
                    on_marker(self, *parsed)
                continue
            try:
                os.write(out, line)
            except OSError:
                pass

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """The wrapper forwards it to the command's group, then SIGKILLs what is left."""
        if self.proc.poll() is not None:
            return
        if self.remote:
            self.tell(signal.Signals(signum).name)
        else:
            try:
                os.kill(self.proc.pid, signum)
            except ProcessLookupError:
                pass

    def how(self) -> str:
        code = self.proc.returncode
        if code is not None and code < 0:
            return f"was killed by signal {-code} ({signal.Signals(-code).name})"
        if code is not None and code > 128 and code - 128 < signal.NSIG:
            return f"was killed by signal {code - 128} ({signal.Signals(code - 128).name})"
        return f"exited with code {code}"


class _Driver:
    def __init__(self, config, min_np: int, reset_limit: Optional[int], timeout: float):
        self.config, self.min_np, self.reset_limit, self.timeout = config, min_np, reset_limit, timeout
        self.job = gloo.GlooJob(config)
        self.workers: List[_Worker] = []
        self.user_error: Optional[str] = None
        self.generation, self.resets = 0, 0
        self.members: List[_Worker] = []

    def _on_marker(self, worker: _Worker, kind: str, fields: dict) -> None:
        if kind == "elastic" and fields.get("event") == "user-error":
            self.user_error = self.user_error or \
                f"{worker.name} (host {worker.host}): {fields.get('text', 'it raised')}"

    def run(self) -> int:
        from horolite.world.rendezvous import HOSTS, RendezvousServer
        key = secrets.token_bytes(32)
        self.server = RendezvousServer(key, host=self.job.bind, port=0)
        slots = self.job.slots
        self.server.put(*HOSTS, "\n".join(s.host for s in slots).encode())
        plan = gloo.build_plan(self.config, slots, self.job.addresses, self.server.port, key,
                               self.job.environ, os.getcwd())
        names = [f"w{s.rank}" for s in slots]
        self.hosts = {name: s.host for name, s in zip(names, slots)}
        self._publish(names)
        previous = {sig: signal.signal(sig, self._on_signal)
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        self.stopping = None
        try:
            for name, spec in zip(names, plan["ranks"]):
                spec["env"].update({WORKER: name, GENERATION_TIMEOUT: f"{self.timeout:g}"})
                self.workers.append(_Worker(name, spec, plan["cwd"], self._on_marker))
            self.members = list(self.workers)
            return self._watch()
        finally:
            for worker in self.workers:
                worker.stop(signal.SIGTERM)
            for worker in self.workers:
                try:
                    worker.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    worker.proc.kill()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.server.close()

    def _on_signal(self, signum, frame) -> None:
        self.stopping = signum

    def _publish(self, names: List[str]) -> None:
        plan = plan_for(self.generation, names, self.hosts)
        self.server.put(SCOPE, f"plan.{self.generation}", json.dumps(plan).encode())
        self.server.put(SCOPE, "latest", str(self.generation).encode())

    def _blamed(self) -> Dict[_Worker, str]:
        """Members of this generation whom a survivor named as the failure's cause."""
        found = {}
        for key, value in self.server.items(SCOPE).items():
            parts = key.split(".")
            if parts[0] != "blame" or parts[1] != str(self.generation) or not value:
                continue
            rank = int(value)
            if 0 <= rank < len(self.members):
                found[self.members[rank]] = f"named by {parts[2]} as the failure's cause"
        return found

    def _watch(self) -> int:
        while True:
            if self.stopping is not None:
                _log(f"stopped by {signal.Signals(self.stopping).name}")
                return 128 + self.stopping
            lost = []
            for worker in self.members:
                if worker.proc.poll() is not None and worker.proc.returncode != 0:
                    lost.append((worker, worker.how()))
            for worker, why in self._blamed().items():
                if worker.proc.poll() is None:
                    worker.stop(signal.SIGTERM)  # (a hung rank: the wrapper SIGKILLs it)
                if all(w is not worker for w, _ in lost):
                    lost.append((worker, why))
            if self.user_error is not None:
                for worker in self.workers:
                    for relay in worker.relays:
                        relay.join(timeout=1)
                _log(f"the training code raised on {self.user_error}: an elastic job is not "
                     "retried for an error of its own")
                return 1
            if lost:
                code = self._next_generation(lost)
                if code is not None:
                    return code
            elif all(w.proc.poll() is not None for w in self.members):
                for worker in self.workers:
                    for relay in worker.relays:
                        relay.join(timeout=5)
                return 0
            time.sleep(POLL_SECONDS)

    def _next_generation(self, lost) -> Optional[int]:
        for worker, why in lost:
            worker.evicted = why
        gone = {w for w, _ in lost}
        self.members = [w for w in self.members if w not in gone]
        said = "; ".join(f"rank {w.rank} ({w.name}, host {w.host}) {why}" for w, why in lost)
        if len(self.members) < self.min_np:
            _log(f"generation {self.generation}: {said}; {len(self.members)} rank(s) left, "
                 f"fewer than --min-np {self.min_np}: the job fails")
            return 1
        self.resets += 1
        if self.reset_limit is not None and self.resets > self.reset_limit:
            _log(f"generation {self.generation}: {said}; that is reset {self.resets}, more "
                 f"than --reset-limit {self.reset_limit}: the job fails")
            return 1
        self.generation += 1
        for rank, worker in enumerate(self.members):
            worker.rank = rank
        self._publish([w.name for w in self.members])
        _log(f"generation {self.generation - 1}: {said}; generation {self.generation}: "
             f"{len(self.members)} rank(s) go on in their running processes")
        return None


def run_elastic_gloo(config, min_np: int, reset_limit: Optional[int], timeout: float) -> int:
    """horolite-run's main() for `--gloo` with `--min-np`."""
    return _Driver(config, min_np, reset_limit, timeout).run()
