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

from horolite.core import settings

from . import elastic_flags, flags
from . import hosts as hostlib
from . import mpi, sources, ssh_check
from .rank_source import SSH
from .version import horolite_version

__all__ = ["LaunchConfig", "get_args_parser", "parse_args", "config_from_args", "tunable_env",
           "main"]

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
    start: str = SSH  # how mpirun starts ranks on the hosts (rank_source.SSH or SLURM)
    start_help: str = ""  # what to check when ranks do not start
    mpirun_env: Tuple[Tuple[str, str], ...] = ()  # added to mpirun's own environment
    ssh_args: str = ""  # options for the ssh that starts remote ranks (-p, -i)
    binding_args: Tuple[str, ...] = ()
    timestamp_output: bool = False


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


def get_args_parser(environ: Optional[Mapping[str, str]] = None) -> argparse.ArgumentParser:
    """horovodrun's flags (tunables from horolite.core.settings) and horolite-run's own.

    `environ` is not read here (defaults from the environment apply in config_from_args)."""
    p = argparse.ArgumentParser(
        prog="horolite-run", allow_abbrev=False,
        description="Launch a horolite job: every rank runs COMMAND under mpirun (MPICH or Open MPI).",
        epilog="Example: horolite-run -np 4 python train.py")
    p.add_argument("-v", "--version", action=_VersionAction)
    p.add_argument("-cb", "--check-build", action="store_true",
                   help="show which frameworks, controllers and tensor operations are available, "
                        "and exit")
    p.add_argument("--verbose", action="store_true",
                   help="print the exact mpirun command before running it")
    p.add_argument("--config-file", metavar="YAML",
                   help="horovodrun's YAML settings file (params, autotune, timeline, stall_check, "
                        "library_options, logging); flags on the command line win over it")
    p.add_argument("--disable-cache", action="store_true",
                   help="accepted for horovodrun: horolite-run caches no checks")
    p.add_argument("--mpi", action="store_true", help="accepted for horovodrun: MPI is the only "
                                                      "controller")

    g = p.add_argument_group("processes and hosts")
    g.add_argument("-np", "--num-proc", type=_positive_int, dest="num_proc",
                   help="number of ranks (default: the total slots of -H/--hostfile, of the Slurm "
                        "allocation or of the MPI Operator's hostfile)")
    hosts = g.add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", help="host1:slots,host2:slots (default: localhost:NP)")
    hosts.add_argument("-hostfile", "--hostfile", help="file of 'host slots=N' lines")
    g.add_argument("--start-timeout", type=flags.non_negative(float),
                   help="seconds every rank has to start before the job is abandoned "
                        "(default 30, or HOROLITE_START_TIMEOUT)")
    g.add_argument("--network-interface", "--network-interfaces", dest="network_interface",
                   action="append",
                   help="network interface(s) for MPI traffic, comma-separated or repeated")
    g.add_argument("--output-filename", metavar="DIR",
                   help="also write each rank's output to DIR/rank.<N>/stdout and .../stderr")
    g.add_argument("-prefix-timestamp", "--prefix-output-with-timestamp", action="store_true",
                   dest="prefix_output_with_timestamp",
                   help="put the time in front of every output line")
    g.add_argument("-p", "--ssh-port", type=_positive_int, help="ssh port of every host")
    g.add_argument("-i", "--ssh-identity-file", metavar="FILE",
                   help="private key ssh uses to reach the hosts")

    g = p.add_argument_group("environment and MPI")
    g.add_argument("-x", "--env", action="append", default=[], metavar="VAR[=VALUE]",
                   help="pass VAR (from this environment, or set to VALUE) to every rank; repeatable")
    g.add_argument("--mpi-args", default="", help="extra mpirun arguments, as one shell-quoted string")
    g.add_argument("--binding-args", default="",
                   help="mpirun's process binding arguments, as one shell-quoted string "
                        "(e.g. --binding-args=\"--bind-to core\"); default: none")
    g.add_argument("--tcp", action="store_true",
                   help="NCCL over TCP only: NCCL_IB_DISABLE=1 on every rank")

    elastic_flags.add_elastic_flags(p)
    flags.add_setting_flags(p)
    flags.add_refused_flags(p)
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program each rank runs")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the command line, then fill unset settings from --config-file."""
    parser = get_args_parser()
    args = parser.parse_args(argv)
    if args.config_file:
        flags.apply_config_file(args, parser)
    return args


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
    start_timeout = flags.launcher_value("START_TIMEOUT", args.start_timeout, environ, 30.0)
    return LaunchConfig(command=tuple(command), num_proc=num_proc, hosts=host_list,
                        env=tuple(env.items()), mpi_args=mpi_args,
                        network_interface=nics, output_filename=output,
                        start_timeout=start_timeout, verbose=args.verbose,
                        ssh_args=flags.ssh_args(args.ssh_port, args.ssh_identity_file),
                        binding_args=binding_args,
                        timestamp_output=args.prefix_output_with_timestamp,
                        start=ranks.start if ranks else SSH,
                        start_help=ranks.help if ranks else "",
                        mpirun_env=ranks.mpirun_env if ranks else ())


def _split(flag: str, text: str) -> Tuple[str, ...]:
    try:
        return tuple(shlex.split(text))
    except ValueError as e:
        raise ValueError(f"bad {flag} {text!r}: {e}") from None


def wrapper_argv(config: LaunchConfig, python: Optional[str] = None) -> Tuple[str, ...]:
    """What every rank runs in front of the command: the rank wrapper."""
    argv = [python or sys.executable, RANKWRAP]
    if config.output_filename:
        argv += ["--output-dir", config.output_filename]
    if config.timestamp_output:
        argv += ["--timestamp"]
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
    parsed = parse_args(args)
    if parsed.check_build:
        from .check_build import check_build
        return check_build()
    if elastic_flags.is_elastic(parsed):
        from .elastic import run_elastic
        return run_elastic(parsed)
    try:
        elastic_flags.check_not_elastic(parsed)
        config = config_from_args(parsed)
        _check_command(config)
        if config.start == SSH:  # Slurm's node names are for srun; mpirun never resolves them
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
                            start_timeout=config.start_timeout, start_help=config.start_help,
                            env=dict(os.environ, **dict(config.mpirun_env)))
    result = supervisor.run()
    if result.message:
        print(f"horolite-run: {result.message}", file=sys.stderr, flush=True)
    return result.exit_code

