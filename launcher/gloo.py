"""``horolite-run --gloo``: start the ranks without mpirun, as ``horovodrun --gloo`` does.

The launcher serves the job's rendezvous (horolite/world/rendezvous.py) under a key
made for this job, lays the ranks out over the hosts as mpirun would (each host's slots
in order), and starts them through rank_spawn.py, which the Supervisor watches as it
watches mpirun: one set of rules for failures, signals and the summary.

The key is never on a command line (``ps`` shows command lines to every user of a
host): a local rank gets it in its environment, a remote one as part of the JSON line
its wrapper reads from ssh's stdin.

The pure parts (``layout``, ``rendezvous_addresses``, ``rank_env``, ``build_plan``) are
unit-tested without starting anything.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import secrets
import shlex
import socket
import sys
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from horolite.world import DEFAULT_TIMEOUT  # (horovodrun's --gloo-timeout-seconds)

from . import flags
from . import hosts as hostlib
from .config import LaunchConfig, wrapper_argv
from .outcome import JobResult
from .supervise import Supervisor

__all__ = ["add_gloo_flags", "RankSlot", "layout", "slots_for", "rendezvous_addresses", "rank_env",
           "build_plan", "GlooJob", "RANK_SPAWN"]

RANK_SPAWN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank_spawn.py")


def add_gloo_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("without MPI")
    g.add_argument("--gloo", action="store_true",
                   help="start the ranks without mpirun: here as processes, on other hosts "
                        "over ssh, meeting at a rendezvous horolite-run serves")
    g.add_argument("--gloo-timeout-seconds", type=_seconds, default=None, metavar="S",
                   help=f"seconds the ranks wait for each other at the rendezvous "
                        f"(default {DEFAULT_TIMEOUT:g})")


def _seconds(text) -> float:
    value = flags.non_negative(float)(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be above 0")
    return value


@dataclasses.dataclass(frozen=True)
class RankSlot:
    """Where one rank runs, and its place on its host and across hosts (Horovod's meaning:
    cross_rank counts the ranks with the same local rank, in rank order)."""
    rank: int
    host: str
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


def layout(hosts: Sequence[hostlib.Host], num_proc: int) -> List[RankSlot]:
    """Ranks fill each host's slots in order (mpirun's default by-slot mapping)."""
    return slots_for(hostlib.rank_hosts(hosts, num_proc))


def slots_for(names: Sequence[str]) -> List[RankSlot]:
    """Each rank's place, rank r on host names[r]."""
    local_rank, seen, same_local = [], {}, {}
    for name in names:
        local_rank.append(seen.get(name, 0))
        seen[name] = local_rank[-1] + 1
    for rank, lr in enumerate(local_rank):
        same_local.setdefault(lr, []).append(rank)
    return [RankSlot(rank, name, local_rank[rank], list(names).count(name),
                     same_local[local_rank[rank]].index(rank), len(same_local[local_rank[rank]]))
            for rank, name in enumerate(names)]


def _route_source(host: str) -> str:
    """This machine's address on the way to `host`: what a process there can reach us at."""
    try:
        target = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))  # no packet is sent: the kernel only picks a route
            return s.getsockname()[0]
    except OSError as e:
        raise ValueError(f"no route from this machine to host {host!r} for the rendezvous: "
                         f"{e.strerror or e}") from None


def _interface_address(nic: str) -> str:
    from horolite.transport import tcp_address
    try:
        return tcp_address.offered("=" + nic)[0].addr
    except (OSError, IndexError) as e:
        raise ValueError(f"--network-interface {nic}: {e}") from None


def rendezvous_addresses(hosts: Sequence[str], nic: Optional[str] = None, *,
                         route=_route_source, nic_address=_interface_address
                         ) -> Tuple[str, Dict[str, str]]:
    """(address the rendezvous listens on, {host: address its ranks reach it at}).

    All hosts this one: loopback only. Otherwise every interface, and each remote host
    gets this machine's address on its route there (or the --network-interface's);
    ranks here get the address the first remote host gets, so one job sees one address
    in the usual case of one network."""
    remote = [h for h in hosts if not hostlib.is_local(h)]
    if not remote:
        return "127.0.0.1", {h: "127.0.0.1" for h in hosts}
    if nic:
        mine = nic_address(nic.split(",")[0])
        return "0.0.0.0", {h: mine for h in hosts}
    found = {h: route(h) for h in remote}
    return "0.0.0.0", {h: found.get(h, found[remote[0]]) for h in hosts}


def rank_env(slot: RankSlot, size: int, addr: str, port: int, timeout: float,
             key: bytes) -> Dict[str, str]:
    """What a rank learns who it is from: horolite's names and Horovod's Gloo ones."""
    env = {"HOROLITE_RANK": slot.rank, "HOROLITE_SIZE": size,
           "HOROLITE_LOCAL_RANK": slot.local_rank, "HOROLITE_LOCAL_SIZE": slot.local_size,
           "HOROLITE_CROSS_RANK": slot.cross_rank, "HOROLITE_CROSS_SIZE": slot.cross_size,
           "HOROLITE_HOSTNAME": slot.host, "HOROLITE_RENDEZVOUS_ADDR": addr,
           "HOROLITE_RENDEZVOUS_PORT": port, "HOROLITE_GLOO_TIMEOUT_SECONDS": f"{timeout:g}",
           "HOROLITE_JOB_KEY": key.hex(),
           "HOROVOD_RANK": slot.rank, "HOROVOD_SIZE": size,
           "HOROVOD_LOCAL_RANK": slot.local_rank, "HOROVOD_LOCAL_SIZE": slot.local_size,
           "HOROVOD_CROSS_RANK": slot.cross_rank, "HOROVOD_CROSS_SIZE": slot.cross_size,
           "HOROVOD_HOSTNAME": slot.host, "HOROVOD_GLOO_RENDEZVOUS_ADDR": addr,
           "HOROVOD_GLOO_RENDEZVOUS_PORT": port, "HOROVOD_CONTROLLER": "gloo",
           "HOROVOD_CPU_OPERATIONS": "gloo"}
    return {name: str(value) for name, value in env.items()}


# What describes the launching shell or host, not the job: not given to remote ranks.
_NOT_EXPORTED = re.compile(r"BASH_FUNC_.*|OLDPWD|PWD|HOSTNAME|SHLVL|_|SSH_.*")


def _forwarded(config: LaunchConfig, environ: Mapping[str, str]) -> Dict[str, str]:
    """The -x/--env variables, settings and paths, with this environment's values."""
    return {name: environ[name] if value is None else value for name, value in config.env
            if value is not None or name in environ}


def _exported(environ: Mapping[str, str]) -> Dict[str, str]:
    """The launcher's whole environment, for ranks on other hosts (a local rank inherits
    it): as horovodrun --gloo and MPICH give it (TF_*, OMP_*, a user's own settings)."""
    return {name: value for name, value in environ.items() if not _NOT_EXPORTED.fullmatch(name)}


def build_plan(config: LaunchConfig, slots: Sequence[RankSlot], addresses: Mapping[str, str],
               port: int, key: bytes, environ: Mapping[str, str], cwd: str,
               python: Optional[str] = None) -> dict:
    """rank_spawn.py's plan: each rank's argv and environment (secret: it holds the key)."""
    python = python or sys.executable
    wrapper = list(wrapper_argv(config, python, hold=0))
    forwarded, exported = _forwarded(config, environ), _exported(environ)
    ssh = ["ssh", "-o", "BatchMode=yes", *shlex.split(config.ssh_args)]
    ranks = []
    for slot in slots:
        remote = not hostlib.is_local(slot.host)
        env = {**(exported if remote else {}), **forwarded,
               **rank_env(slot, len(slots), addresses[slot.host], port, config.gloo_timeout, key)}
        if remote:
            inner = wrapper[:-1] + ["--env-stdin", "--"] + list(config.command)
            argv = ssh + [slot.host, "exec " + shlex.join(inner)]
        else:
            argv = wrapper + list(config.command)
        ranks.append({"rank": slot.rank, "host": slot.host, "argv": argv, "env": env,
                      "remote": remote})
    return {"cwd": cwd, "ranks": ranks}


class GlooJob:
    """One --gloo job: checked at construction (ValueError), run by run()."""

    def __init__(self, config: LaunchConfig, environ: Optional[Mapping[str, str]] = None):
        self.config = config
        self.environ = dict(os.environ if environ is None else environ)
        self.slots = layout(config.hosts, config.num_proc)
        used = list(dict.fromkeys(s.host for s in self.slots))
        self.bind, self.addresses = rendezvous_addresses(used, config.network_interface)

    def run(self, log=None) -> Tuple[Supervisor, JobResult]:
        from horolite.world.rendezvous import HOSTS, RendezvousServer
        log = log or (lambda msg: print(f"horolite-run: {msg}", file=sys.stderr, flush=True))
        config = self.config
        key = secrets.token_bytes(32)
        server = RendezvousServer(key, host=self.bind, port=0)
        server.put(*HOSTS, "\n".join(s.host for s in self.slots).encode())
        try:
            plan = build_plan(config, self.slots, self.addresses, server.port, key,
                              self.environ, os.getcwd())
            argv = [sys.executable, RANK_SPAWN, "--ssh-args", config.ssh_args]
            if config.verbose:
                log(f"--gloo: rendezvous on {self.bind}:{server.port}, reached at "
                    + ", ".join(sorted({f'{a}:{server.port}' for a in self.addresses.values()})))
                for rank in plan["ranks"]:
                    log(f"rank {rank['rank']} on {rank['host']}: {shlex.join(rank['argv'])}")
            supervisor = Supervisor(argv, config.num_proc, [s.host for s in self.slots],
                                    start_timeout=config.start_timeout,
                                    start_help=config.start_help,
                                    env=dict(self.environ, **dict(config.mpirun_env)),
                                    stdin=json.dumps(plan).encode())
            return supervisor, supervisor.run()
        finally:
            server.close()
