"""What one start of ``horolite-run`` runs: the parsed flags checked into a frozen
LaunchConfig, and what every rank runs in front of the command.

Both the plain launcher (main.py) and the elastic driver (elastic.py) build on it, so
neither imports the other.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import shutil
import sys
from typing import Mapping, Optional, Tuple

from horolite.core import settings

from . import flags, sources
from . import hosts as hostlib
from .rank_source import SSH

__all__ = ["LaunchConfig", "tunable_env", "config_from_args", "wrapper_argv", "check_command",
           "RANKWRAP", "RANK_ENVIRONMENT"]

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
RANK_ENVIRONMENT = ("PATH", "VIRTUAL_ENV", "PYTHONPATH", "LD_LIBRARY_PATH")
RANKWRAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rankwrap.py")
# How long a failed rank's wrapper stays up for horolite-run to end the job (rankwrap.py
# --hold): more than the supervisor's fail_grace + kill_grace, so it is only a last resort.
HOLD_SECONDS = 10.0


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    command: Tuple[str, ...]
    num_proc: int
    hosts: Tuple[Tuple[str, int], ...] = ()  # empty: this host only
    env: Tuple[Tuple[str, Optional[str]], ...] = ()  # (name, value); value None: pass as is
    mpi_args: Tuple[str, ...] = ()
    network_interface: Optional[str] = None
    output_filename: Optional[str] = None
    start_timeout: float = 30.0
    verbose: bool = False
    start: str = SSH  # how mpirun starts ranks on the hosts (rank_source.SSH or SLURM)
    start_help: str = ""  # what to check when ranks do not start
    mpirun_env: Tuple[Tuple[str, str], ...] = ()  # added to mpirun's own environment
    ssh_args: str = ""  # options for the ssh that starts remote ranks (-p, -i)
    binding_args: Tuple[str, ...] = ()
    timestamp_output: bool = False
    gloo: bool = False  # start the ranks without mpirun (gloo.py)
    gloo_timeout: float = 30.0  # --gloo-timeout-seconds: the ranks' rendezvous timeout


def tunable_env(args: argparse.Namespace) -> Tuple[Tuple[str, str], ...]:
    """The variables the setting flags (and --tcp) set on every rank."""
    env = flags.setting_env(args)
    if args.tcp:
        env += (("NCCL_IB_DISABLE", "1"),)
    return env


def config_from_args(args: argparse.Namespace,
                     environ: Optional[Mapping[str, str]] = None,
                     ranks=sources.DISCOVER) -> LaunchConfig:
    """Validate the parsed flags into a LaunchConfig; ValueError says what is wrong.
    `ranks`: where the ranks go (default: found by sources.discover)."""
    environ = os.environ if environ is None else environ
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise ValueError("no command given (usage: horolite-run -np 4 python train.py)")
    if ranks is sources.DISCOVER:
        ranks = sources.discover(args, environ)  # -H, --hostfile, Slurm, MPI Operator
    host_list = ranks.hosts if ranks else ()
    slots = hostlib.total_slots(host_list)
    num_proc = args.num_proc if args.num_proc is not None else slots
    if not num_proc:
        raise ValueError("give the number of ranks with -np N (or hosts with -H/--hostfile)")
    if host_list and num_proc > slots:
        raise ValueError(f"-np {num_proc} is more than the {slots} slots of {ranks.origin} "
                         f"({', '.join(f'{h}:{n}' for h, n in host_list)})")

    env = dict(tunable_env(args))
    for item in args.env:
        name, eq, value = item.partition("=")
        if not _ENV_NAME.match(name):
            raise ValueError(f"bad -x/--env {item!r}: expected VAR or VAR=VALUE")
        if eq:
            env[name] = value
        elif name not in environ:
            raise ValueError(f"-x {name}: {name} is not set in this environment "
                             f"(use -x {name}=VALUE)")
        else:
            env.setdefault(name, None)
    # The launcher's own HOROLITE_*/HOROVOD_* settings reach remote ranks too.
    launcher_only = {prefix + s.name for s in settings.SETTINGS if s.scope == "launcher"
                     for prefix in settings.PREFIXES}
    for name in sorted(environ):
        if name.startswith(settings.PREFIXES) and name not in env and name not in launcher_only:
            env[name] = None
    # What a rank on another host needs to find the same Python, packages and libraries
    # (Open MPI gives remote ranks only what is named; MPICH passes everything).
    for name in RANK_ENVIRONMENT:
        if name in environ:
            env.setdefault(name, None)
    mpi_args, binding_args = (_split(flag, getattr(args, flag[2:].replace("-", "_")) or "")
                              for flag in ("--mpi-args", "--binding-args"))
    output = os.path.abspath(args.output_filename) if args.output_filename else None
    nics = ",".join(args.network_interface) if args.network_interface else None
    if nics and not any(prefix + "TCP_IFACE" in env for prefix in settings.PREFIXES):
        env["HOROLITE_TCP_IFACE"] = nics.split(",")[0]  # horolite's own connections too
    start_timeout = flags.launcher_value("START_TIMEOUT", args.start_timeout, environ, 30.0)
    gloo = bool(getattr(args, "gloo", False))
    if gloo:
        _check_gloo(args, mpi_args, binding_args, ranks)
    gloo_timeout = getattr(args, "gloo_timeout_seconds", None)
    return LaunchConfig(command=tuple(command), num_proc=num_proc, hosts=host_list,
                        env=tuple(env.items()), mpi_args=mpi_args,
                        network_interface=nics, output_filename=output,
                        start_timeout=start_timeout, verbose=args.verbose,
                        ssh_args=flags.ssh_args(args.ssh_port, args.ssh_identity_file),
                        binding_args=binding_args,
                        timestamp_output=args.prefix_output_with_timestamp,
                        start=ranks.start if ranks else SSH,
                        start_help=ranks.help if ranks else "",
                        mpirun_env=ranks.mpirun_env if ranks else (), gloo=gloo,
                        gloo_timeout=30.0 if gloo_timeout is None else gloo_timeout)


def _check_gloo(args, mpi_args, binding_args, ranks) -> None:
    """ValueError for what --gloo cannot honour: it starts the ranks without mpirun."""
    if getattr(args, "mpi", False):
        raise ValueError("--gloo and --mpi ask for two ways to start the ranks: give one")
    for flag, given in (("--mpi-args", mpi_args), ("--binding-args", binding_args)):
        if given:
            raise ValueError(f"{flag} is for mpirun, and --gloo starts the ranks without it "
                             f"(drop {flag}, or --gloo)")
    if ranks is not None and ranks.start != SSH:
        raise ValueError(f"--gloo starts remote ranks with ssh, not within {ranks.origin}: "
                         "name the hosts with -H/--hostfile, or start the ranks with srun")


def _split(flag: str, text: str) -> Tuple[str, ...]:
    try:
        return tuple(shlex.split(text))
    except ValueError as e:
        raise ValueError(f"bad {flag} {text!r}: {e}") from None


def wrapper_argv(config: LaunchConfig, python: Optional[str] = None,
                 hold: float = HOLD_SECONDS) -> Tuple[str, ...]:
    """What every rank runs in front of the command: the rank wrapper. `hold`: 0 where
    no mpirun ends the job as the first wrapper fails (--gloo)."""
    argv = [python or sys.executable, RANKWRAP] + (["--hold", f"{hold:g}"] if hold else [])
    if config.output_filename:
        argv += ["--output-dir", config.output_filename]
    if config.timestamp_output:
        argv += ["--timestamp"]
    return tuple(argv) + ("--",)


def check_command(config: LaunchConfig) -> None:
    """ValueError when the command to run is not there (before any rank starts)."""
    program = config.command[0]
    if os.sep in program:
        if not os.path.exists(program):
            raise ValueError(f"command not found: {program}")
    elif shutil.which(program) is None:
        raise ValueError(f"command not found: {program!r} is not on PATH")
