"""``horolite-run``: start a horolite job over a real ``mpirun``.

get_args_parser() -> LaunchConfig (frozen) -> build_mpirun_command() (pure,
in mpi.py) -> main(args=None). Tests call ``main([...])`` in-process.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import shutil
import sys
from typing import Mapping, Optional, Sequence, Tuple

from . import hosts as hostlib
from . import mpi
from . import ssh_check
from .version import horolite_version

__all__ = ["LaunchConfig", "get_args_parser", "config_from_args", "tunable_env", "main"]

_LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
RANK_ENVIRONMENT = ("PATH", "VIRTUAL_ENV", "PYTHONPATH", "LD_LIBRARY_PATH")
RANKWRAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rankwrap.py")


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


def _env_default(names: Sequence[str], default, environ: Mapping[str, str]):
    for name in names:
        if environ.get(name):
            return environ[name]
    return default


class _VersionAction(argparse.Action):
    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help="print horolite's version and exit"):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"horolite-run {horolite_version()}")
        parser.exit()


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _non_negative(kind):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"{text} must not be negative")
        return value
    parse.__name__ = kind.__name__
    return parse


def get_args_parser(environ: Optional[Mapping[str, str]] = None) -> argparse.ArgumentParser:
    environ = os.environ if environ is None else environ
    p = argparse.ArgumentParser(
        prog="horolite-run",
        description="Launch a horolite job: every rank runs COMMAND under mpirun (MPICH or Open MPI).",
        epilog="Example: horolite-run -np 4 python train.py")
    p.add_argument("--version", action=_VersionAction)
    p.add_argument("-cb", "--check-build", action="store_true",
                   help="show which frameworks, controllers and tensor operations are available, "
                        "and exit")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="print the exact mpirun command before running it")

    g = p.add_argument_group("processes and hosts")
    g.add_argument("-np", "--num-proc", type=_positive_int, dest="num_proc",
                   help="number of ranks (default: the total slots of -H/--hostfile)")
    hosts = g.add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", help="host1:slots,host2:slots (default: localhost:NP)")
    hosts.add_argument("-hostfile", "--hostfile", help="file of 'host slots=N' lines")
    g.add_argument("--start-timeout", type=_non_negative(float),
                   default=float(_env_default(("HOROLITE_START_TIMEOUT", "HOROVOD_START_TIMEOUT"),
                                              30, environ)),
                   help="seconds every rank has to start before the job is abandoned "
                        "(default 30, or HOROLITE_START_TIMEOUT)")
    g.add_argument("--network-interface", "--network-interfaces", dest="network_interface",
                   help="network interface(s) for MPI traffic, comma-separated (e.g. eth0)")
    g.add_argument("--output-filename", metavar="DIR",
                   help="also write each rank's output to DIR/rank.<N>/stdout and .../stderr")

    g = p.add_argument_group("environment and MPI")
    g.add_argument("-x", "--env", action="append", default=[], metavar="VAR[=VALUE]",
                   help="pass VAR (from this environment, or set to VALUE) to every rank; repeatable")
    g.add_argument("--mpi-args", default="", help="extra mpirun arguments, as one shell-quoted string")

    g = p.add_argument_group("tunables (set HOROLITE_* variables on every rank)")
    g.add_argument("--fusion-threshold-mb", type=_non_negative(float),
                   help="fusion buffer size in MiB; 0 disables fusion (HOROLITE_FUSION_THRESHOLD)")
    g.add_argument("--cycle-time-ms", type=_non_negative(float),
                   help="milliseconds between background cycles (HOROLITE_CYCLE_TIME)")
    g.add_argument("--cache-capacity", type=_non_negative(int),
                   help="response cache entries; 0 disables it (HOROLITE_CACHE_CAPACITY)")
    g.add_argument("--timeline-filename", help="write a Chrome trace timeline here (HOROLITE_TIMELINE)")
    g.add_argument("--timeline-mark-cycles", action="store_true",
                   help="mark background cycles in the timeline (HOROLITE_TIMELINE_MARK_CYCLES)")
    g.add_argument("--no-stall-check", action="store_true",
                   help="turn the stall inspector off (HOROLITE_STALL_CHECK_DISABLE)")
    g.add_argument("--stall-check-warning-time-seconds", type=_non_negative(float),
                   help="report tensors waiting for other ranks this long "
                        "(HOROLITE_STALL_CHECK_TIME_SECONDS)")
    g.add_argument("--stall-check-shutdown-time-seconds", type=_non_negative(float),
                   help="shut a stalled job down after this long "
                        "(HOROLITE_STALL_SHUTDOWN_TIME_SECONDS)")
    g.add_argument("--log-level", type=str.upper, choices=_LOG_LEVELS,
                   help="runtime log level (HOROLITE_LOG_LEVEL)")
    g.add_argument("--autotune", action="store_true",
                   help="tune fusion threshold and cycle time online (HOROLITE_AUTOTUNE)")
    g.add_argument("--autotune-log-file", help="CSV file of autotune samples (HOROLITE_AUTOTUNE_LOG)")
    g.add_argument("--autotune-start", metavar="SETTINGS",
                   help="where autotune starts, e.g. cycle_time_ms=50 (HOROLITE_AUTOTUNE_START)")
    g.add_argument("--wait-mode", choices=("poll", "block"),
                   help="how the background thread waits on MPI (HOROLITE_WAIT_MODE)")
    g.add_argument("--no-shared-memory", action="store_true",
                   help="reduce over MPI's ring even when all ranks share a host "
                        "(HOROLITE_SHARED_MEMORY=0)")

    p.add_argument("command", nargs=argparse.REMAINDER, help="the program each rank runs")
    return p


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def tunable_env(args: argparse.Namespace) -> Tuple[Tuple[str, str], ...]:
    """The HOROLITE_* variables the tunable flags set (names are horolite/config.py's)."""
    env = []
    if args.fusion_threshold_mb is not None:
        env.append(("HOROLITE_FUSION_THRESHOLD", str(int(args.fusion_threshold_mb * 1024 * 1024))))
    if args.cycle_time_ms is not None:
        env.append(("HOROLITE_CYCLE_TIME", _number(args.cycle_time_ms)))
    if args.cache_capacity is not None:
        env.append(("HOROLITE_CACHE_CAPACITY", str(args.cache_capacity)))
    if args.timeline_filename:
        env.append(("HOROLITE_TIMELINE", os.path.abspath(args.timeline_filename)))
    if args.timeline_mark_cycles:
        env.append(("HOROLITE_TIMELINE_MARK_CYCLES", "1"))
    if args.no_stall_check:
        env.append(("HOROLITE_STALL_CHECK_DISABLE", "1"))
    if args.stall_check_warning_time_seconds is not None:
        env.append(("HOROLITE_STALL_CHECK_TIME_SECONDS",
                    _number(args.stall_check_warning_time_seconds)))
    if args.stall_check_shutdown_time_seconds is not None:
        env.append(("HOROLITE_STALL_SHUTDOWN_TIME_SECONDS",
                    _number(args.stall_check_shutdown_time_seconds)))
    if args.log_level:
        env.append(("HOROLITE_LOG_LEVEL", args.log_level))
    if args.autotune:
        env.append(("HOROLITE_AUTOTUNE", "1"))
    if args.autotune_log_file:
        env.append(("HOROLITE_AUTOTUNE_LOG", os.path.abspath(args.autotune_log_file)))
    if args.autotune_start:
        env.append(("HOROLITE_AUTOTUNE_START", args.autotune_start))
    if args.wait_mode:
        env.append(("HOROLITE_WAIT_MODE", args.wait_mode))
    if args.no_shared_memory:
        env.append(("HOROLITE_SHARED_MEMORY", "0"))
    return tuple(env)


def config_from_args(args: argparse.Namespace,
                     environ: Optional[Mapping[str, str]] = None) -> LaunchConfig:
    """Validate the parsed flags into a LaunchConfig; ValueError says what is wrong."""
    environ = os.environ if environ is None else environ
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise ValueError("no command given (usage: horolite-run -np 4 python train.py)")
    if args.hosts:
        host_list = hostlib.parse_hosts(args.hosts)
    elif args.hostfile:
        try:
            with open(args.hostfile, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ValueError(f"cannot read --hostfile {args.hostfile}: {e.strerror}") from None
        host_list = hostlib.parse_hostfile(text, args.hostfile)
    else:
        host_list = ()
    slots = hostlib.total_slots(host_list)
    num_proc = args.num_proc if args.num_proc is not None else slots
    if not num_proc:
        raise ValueError("give the number of ranks with -np N (or hosts with -H/--hostfile)")
    if host_list and num_proc > slots:
        raise ValueError(f"-np {num_proc} is more than the {slots} slots of the hosts "
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
    for name in sorted(environ):
        if name.startswith(("HOROLITE_", "HOROVOD_")) and name not in env and \
                name not in ("HOROLITE_MPIRUN", "HOROLITE_START_TIMEOUT", "HOROVOD_START_TIMEOUT"):
            env[name] = None
    # What a rank on another host needs to find the same Python, packages and libraries
    # (Open MPI gives remote ranks only what is named; MPICH passes everything).
    for name in RANK_ENVIRONMENT:
        if name in environ:
            env.setdefault(name, None)
    try:
        mpi_args = tuple(shlex.split(args.mpi_args or ""))
    except ValueError as e:
        raise ValueError(f"bad --mpi-args {args.mpi_args!r}: {e}") from None
    output = os.path.abspath(args.output_filename) if args.output_filename else None
    return LaunchConfig(command=tuple(command), num_proc=num_proc, hosts=host_list,
                        env=tuple(env.items()), mpi_args=mpi_args,
                        network_interface=args.network_interface, output_filename=output,
                        start_timeout=args.start_timeout, verbose=args.verbose)


def wrapper_argv(config: LaunchConfig, python: Optional[str] = None) -> Tuple[str, ...]:
    """What every rank runs in front of the command: the rank wrapper."""
    argv = [python or sys.executable, RANKWRAP]
    if config.output_filename:
        argv += ["--output-dir", config.output_filename]
    return tuple(argv) + ("--",)


def _check_command(config: LaunchConfig) -> None:
    program = config.command[0]
    if os.sep in program:
        if not os.path.exists(program):
            raise ValueError(f"command not found: {program}")
    elif shutil.which(program) is None:
        raise ValueError(f"command not found: {program!r} is not on PATH")


def _error(message: str) -> int:
    print(f"horolite-run: error: {message}", file=sys.stderr, flush=True)
    return 2


def main(args: Optional[Sequence[str]] = None) -> int:
    parser = get_args_parser()
    parsed = parser.parse_args(args)
    if parsed.check_build:
        from .check_build import check_build
        return check_build()
    try:
        config = config_from_args(parsed)
        _check_command(config)
        hostlib.check_resolvable(config.hosts)
        ssh_check.check_reachable(config)
        install = mpi.find_mpi()
    except (ValueError, mpi.NoMPIError) as e:
        return _error(str(e))
    if config.output_filename:
        os.makedirs(config.output_filename, exist_ok=True)
    argv = mpi.build_mpirun_command(config, install.implementation, install.path,
                                    as_root=(os.geteuid() == 0), wrapper=wrapper_argv(config))
    if config.verbose:
        print(f"horolite-run: {install.version}", file=sys.stderr)
        print(f"horolite-run: {shlex.join(argv)}", file=sys.stderr, flush=True)
    from .supervise import Supervisor
    supervisor = Supervisor(argv, config.num_proc,
                            hostlib.rank_hosts(config.hosts, config.num_proc),
                            start_timeout=config.start_timeout)
    result = supervisor.run()
    if result.message:
        print(f"horolite-run: {result.message}", file=sys.stderr, flush=True)
    return result.exit_code

