"""horolite-run's elastic driver: restart the job on the hosts available, from the last commit.

Over MPI the ranks of a job are a fixed world, so elasticity is by restart (as
torchrun does): the driver keeps a pool of hosts (host_pool.py), starts one mpirun
on up to --max-np of their slots, and when the job cannot go on it starts it again:

- a rank failed (killed, lost, a runtime error): its host is blacklisted and the
  job restarts on at least --min-np slots;
- the pool changed (discovery script, a blacklisted host back after its cooldown):
  the driver writes the update file; every rank sees it at its next
  ``state.commit()``/``check_host_updates()``, writes its state and leaves, and
  the job restarts on the new hosts;
- the training code raised: the job ends with that error (not restarted).

Each start is a "generation"; ranks resume from the newest commit any of them
kept in host memory (horolite/elastic/run.py). Every wait is bounded: slots are
awaited at most --elastic-timeout, restarts are capped by --reset-limit.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Dict, List

from horolite.elastic import protocol

from . import elastic_flags, mpi, sources
from . import hosts as hostlib
from .config import check_command, config_from_args, wrapper_argv
from .host_pool import DiscoveryScript, FixedHosts, HostPool, assign
from .rank_source import SSH, Ranks
from .supervise import Supervisor, describe_exit

__all__ = ["run_elastic", "ElasticFailure"]

POLL_SECONDS = 1.0
_SILENT = re.compile(r"no word from ((?:rank \d+ \(host [^)]+\)(?:, )?)+)")  # how often the pool is asked again (Horovod: every second)


class ElasticFailure(RuntimeError):
    """The elastic job cannot go on; the message says why."""


def _log(message: str) -> None:
    print(f"horolite-run: elastic: {message}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class _Outcome:
    kind: str  # "done", "user-error", "reset", "failed", "stopped"
    result: object
    failed_hosts: List[str] = dataclasses.field(default_factory=list)
    why: str = ""


class _Generation:
    """One mpirun of the job: its supervisor, the ranks' elastic markers, and a thread that
    announces pool changes to the ranks while it runs."""

    def __init__(self, driver: "_Driver", hosts, argv):
        self.driver = driver
        self.hosts = hosts
        self.markers: List[Dict[str, str]] = []
        num_proc = hostlib.total_slots(hosts)
        self.rank_hosts = hostlib.rank_hosts(hosts, num_proc)
        config = driver.base
        self.supervisor = Supervisor(argv, num_proc, self.rank_hosts,
                                     start_timeout=config.start_timeout,
                                     # Nothing to save once a rank is gone (the commits
                                     # are written): end the job quickly, restart sooner.
                                     fail_grace=0.5, kill_grace=1.5,
                                     start_help=config.start_help,
                                     env=dict(os.environ, **dict(config.mpirun_env)),
                                     on_marker=self._on_marker)
        self._done = threading.Event()

    def _on_marker(self, kind, fields) -> None:
        if kind == protocol.MARKER_KIND:
            self.markers.append(fields)

    def _watch(self) -> None:
        announced = self.hosts
        while not self._done.wait(POLL_SECONDS):
            pool = self.driver.pool
            pool.refresh()
            wanted = assign(pool.available(), self.driver.cfg.max_np)
            if wanted == announced or hostlib.total_slots(wanted) < self.driver.cfg.min_np:
                continue
            removed_only = set(wanted) <= set(self.hosts) and wanted != self.hosts
            announced = wanted
            self.driver.update_number += 1
            protocol.write_update(self.driver.notify, self.driver.update_number, removed_only)
            _log(f"hosts changed: {pool.describe()}; the ranks restart on "
                 f"{_hosts_text(wanted)} at their next commit")

    def run(self) -> _Outcome:
        watcher = threading.Thread(target=self._watch, name="horolite-elastic-watch",
                                   daemon=True)
        watcher.start()
        try:
            result = self.supervisor.run()
        finally:
            self._done.set()
            watcher.join(timeout=5)
        return self._classify(result)

    def _classify(self, result) -> _Outcome:
        sup = self.supervisor
        events = {m.get("event") for m in self.markers}
        if sup.interrupted is not None:
            return _Outcome("stopped", result)
        if protocol.USER_ERROR in events and result.exit_code != 0:
            return _Outcome("user-error", result)
        if result.exit_code == 0:
            return _Outcome("reset" if protocol.RESET in events else "done", result,
                            why="the hosts changed")
        hosts, failed = self._blame()
        why = "; ".join(describe_exit(s) if s.started else f"rank {s.rank} did not start"
                        for s in failed[:4]) or result.message
        return _Outcome("failed", result, failed_hosts=hosts, why=why)

    def _blame(self):
        """(hosts, ranks) that made the job fail. Only the first failure counts: once one
        rank is gone the others end too (lost-peer errors, SIGTERM, even a crash inside
        MPI), and those are consequences, not failed hosts."""
        sup = self.supervisor
        first = sup.first_failure
        if first is not None and first.signal:  # killed or crashed first
            failed = [first]
        elif sup.cause is not None and _SILENT.search(sup.cause[2]):
            # A stall: the ranks that went silent (a link or host down) are to blame.
            named = _SILENT.search(sup.cause[2]).group(1)
            ranks = [int(r) for r in re.findall(r"rank (\d+) \(host", named)]
            failed = [sup.ranks[r] for r in ranks if r in sup.ranks]
        elif sup.cause is not None and sup.cause[1] in sup.ranks:
            failed = [sup.ranks[sup.cause[1]]]
        elif first is not None:
            failed = [first]
        elif sup.timed_out:
            failed = [s for s in sup.ranks.values() if not s.started]
        else:
            failed = []
        hosts = sorted({self.rank_hosts[s.rank] for s in failed if s.rank < len(self.rank_hosts)})
        return hosts, failed


def _hosts_text(hosts) -> str:
    return ",".join(f"{h}:{n}" for h, n in hosts)


class _Driver:
    def __init__(self, parsed, environ):
        found = sources.discover(parsed, environ)
        pool_slots = hostlib.total_slots(found.hosts) if found else None
        self.cfg = elastic_flags.elastic_config(parsed, environ, pool_slots)
        if self.cfg.script:
            if found is not None and found.start != SSH:
                raise ValueError("--host-discovery-script cannot be combined with the hosts of "
                                 f"{found.origin}")
            if getattr(parsed, "hosts", None) or getattr(parsed, "hostfile", None):
                raise ValueError("give hosts with --host-discovery-script or with "
                                 "-H/--hostfile, not both")
            discovery = DiscoveryScript(self.cfg.script, self.cfg.slots_per_host)
            found = Ranks((), discovery.describe())
        elif found is None:
            found = Ranks((("localhost", self.cfg.num_proc),), f"localhost:{self.cfg.num_proc}")
            discovery = FixedHosts(found.hosts, found.origin)
        else:
            discovery = FixedHosts(found.hosts, found.origin)
        args = copy.copy(parsed)
        args.num_proc = 1  # the hosts and the count are chosen at each start
        self.base = config_from_args(args, environ, ranks=dataclasses.replace(found, hosts=()))
        self.pool = HostPool(discovery, self.cfg.cooldown)
        self.job = uuid.uuid4().hex[:12]
        self.workdir = tempfile.mkdtemp(prefix=f"horolite-elastic-{self.job}-")
        self.notify = os.path.join(self.workdir, "hosts-updated")
        self.update_number = 0
        self.used_hosts: set = set()

    def wait_for_slots(self, needed: int):
        """The hosts of the next start: at least `needed` slots, within --elastic-timeout."""
        deadline = time.monotonic() + self.cfg.timeout
        told = False
        while True:
            hosts = assign(self.pool.available(), self.cfg.max_np)
            if hostlib.total_slots(hosts) >= needed:
                return hosts
            if not self.pool.can_change():
                raise ElasticFailure(f"need {needed} slots, and no more can come: "
                                     f"{self.pool.describe()}")
            if time.monotonic() >= deadline:
                raise ElasticFailure(f"timed out after --elastic-timeout "
                                     f"{self.cfg.timeout:g} s waiting for {needed} slots: "
                                     f"{self.pool.describe()}")
            if not told:
                told = True
                _log(f"waiting up to {self.cfg.timeout:g} s for {needed} slots: "
                     f"{self.pool.describe()}")
            time.sleep(min(POLL_SECONDS, max(0.0, deadline - time.monotonic())))
            self.pool.refresh()

    def argv(self, hosts, generation: int):
        env = dict(self.base.env)
        env.update({protocol.JOB: self.job, protocol.GENERATION: str(generation),
                    protocol.NOTIFY: self.notify, protocol.SEEN: str(self.update_number)})
        root = os.environ.get(protocol.COMMIT_DIR)
        if root:
            env[protocol.COMMIT_DIR] = root
        config = dataclasses.replace(self.base, hosts=tuple(hosts),
                                     num_proc=hostlib.total_slots(hosts), env=tuple(env.items()))
        install = mpi.find_mpi()
        argv = mpi.build_mpirun_command(config, install.implementation, install.path,
                                        as_root=(os.geteuid() == 0), wrapper=wrapper_argv(config))
        if self.base.verbose:
            _log(shlex.join(argv))
        return argv

    def run(self) -> int:
        self.pool.refresh(first=True)
        generation, resets = 0, 0
        needed = self.cfg.num_proc
        while True:
            hosts = self.wait_for_slots(needed)
            if self.used_hosts and not self.used_hosts & {h for h, _ in hosts}:
                raise ElasticFailure(f"no host of the previous start is left ({_hosts_text(hosts)} "
                                     "are all new): the committed state cannot be broadcast")
            self.used_hosts = {h for h, _ in hosts}
            _log(f"generation {generation}: {hostlib.total_slots(hosts)} ranks on "
                 f"{_hosts_text(hosts)}")
            run = _Generation(self, hosts, self.argv(hosts, generation))
            outcome = run.run()
            result = outcome.result
            straggler = run.supervisor.stragglers.get("window")
            if straggler and outcome.kind not in ("done", "stopped"):
                # Named for whoever reads the restart log; never evicted for it.
                _log(f"generation {generation}: {straggler} (rank 0's latest straggler "
                     "report; the rank is not evicted for it)")
            if outcome.kind in ("done", "stopped"):
                if result.message:
                    print(f"horolite-run: {result.message}", file=sys.stderr, flush=True)
                return result.exit_code
            if outcome.kind == "user-error":
                print(f"horolite-run: {result.message} (an error of the training code: an "
                      "elastic job is not restarted for it)", file=sys.stderr, flush=True)
                return result.exit_code
            if outcome.kind == "failed":
                if not outcome.failed_hosts:
                    raise ElasticFailure(f"the job failed and no host can be blamed: "
                                         f"{result.message}")
                for host in outcome.failed_hosts:
                    self.pool.blacklist_host(host, outcome.why)
                _log(f"generation {generation} failed ({outcome.why}); blacklisted "
                     f"{', '.join(outcome.failed_hosts)}")
            resets += 1
            if self.cfg.reset_limit is not None and resets > self.cfg.reset_limit:
                raise ElasticFailure(f"the job needed reset {resets} ({outcome.why}), more than "
                                     f"--reset-limit {self.cfg.reset_limit}")
            needed = self.cfg.min_np
            generation += 1
            self.pool.refresh()

    def cleanup(self) -> None:
        """Remove the commits: here, and over ssh on the other hosts used (best effort)."""
        shutil.rmtree(self.workdir, ignore_errors=True)
        directory = protocol.job_dir(self.job)
        shutil.rmtree(directory, ignore_errors=True)
        if self.base.start != SSH:
            return
        remote = [h for h in self.used_hosts | set(self.pool.slots) if not hostlib.is_local(h)]
        procs = []
        for host in remote:
            ssh = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5",
                   *shlex.split(self.base.ssh_args), host, "rm", "-rf", shlex.quote(directory)]
            try:
                procs.append(subprocess.Popen(ssh, stdout=subprocess.DEVNULL,
                                              stderr=subprocess.DEVNULL))
            except OSError:
                break
        deadline = time.monotonic() + 10
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def run_elastic(parsed, environ=None) -> int:
    """horolite-run's main() for an elastic job."""
    environ = os.environ if environ is None else environ
    try:
        driver = _Driver(parsed, environ)
        check_command(driver.base)
        mpi.find_mpi()
    except (ValueError, RuntimeError, mpi.NoMPIError) as e:
        print(f"horolite-run: error: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        return driver.run()
    except (ElasticFailure, RuntimeError, ValueError) as e:
        print(f"horolite-run: elastic job failed: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:  # between two starts (during one, the supervisor handles it)
        print("horolite-run: elastic job stopped by SIGINT", file=sys.stderr, flush=True)
        return 130
    finally:
        driver.cleanup()
