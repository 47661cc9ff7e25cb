"""``horolite-run``: start a horolite job over a real ``mpirun``, or without it (--gloo).

get_args_parser() -> LaunchConfig (frozen, config.py) -> build_mpirun_command() (pure,
in mpi.py) -> main(args=None). Tests call ``main([...])`` in-process. An elastic job
goes to elastic.py, which builds on config.py too and never imports this module; a
--gloo job to gloo.py, which starts the ranks itself.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import Mapping, Optional, Sequence

from . import elastic_flags, flags, gloo
from . import hosts as hostlib
from . import mpi, ssh_check
from .check_build import check_build
from .config import (RANKWRAP, LaunchConfig, check_command, config_from_args, tunable_env,
                     wrapper_argv)
from .rank_source import SSH
from .supervise import Supervisor
from .version import horolite_version

__all__ = ["LaunchConfig", "get_args_parser", "parse_args", "config_from_args", "tunable_env",
           "wrapper_argv", "RANKWRAP", "main"]


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
        description="Launch a horolite job: every rank runs COMMAND under mpirun (MPICH or "
                    "Open MPI), or, with --gloo, started by horolite-run itself.",
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

    gloo.add_gloo_flags(p)
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


def _error(message: str) -> int:
    print(f"horolite-run: error: {message}", file=sys.stderr, flush=True)
    return 2


def main(args: Optional[Sequence[str]] = None) -> int:
    parsed = parse_args(args)
    if parsed.check_build:
        return check_build()
    if elastic_flags.is_elastic(parsed) and parsed.gloo:
        return _run_elastic_gloo(parsed)
    if elastic_flags.is_elastic(parsed):
        # Imported here: elastic.py reaches horolite.elastic and so mpi4py's MPI, which
        # fails to load where no MPI library is installed; a plain start must get as far
        # as its own error naming the fix (mpi.py).
        from .elastic import run_elastic
        return run_elastic(parsed)
    try:
        elastic_flags.check_not_elastic(parsed)
        config = config_from_args(parsed)
        check_command(config)
        if config.start == SSH:  # Slurm's node names are for srun; mpirun never resolves them
            hostlib.check_resolvable(config.hosts)
            ssh_check.check_reachable(config)
        if config.gloo:
            job = gloo.GlooJob(config)
        else:
            install = mpi.find_mpi()
    except (ValueError, mpi.NoMPIError) as e:
        return _error(str(e))
    if config.output_filename:
        os.makedirs(config.output_filename, exist_ok=True)
    if config.gloo:
        supervisor, result = job.run()
    else:
        supervisor, result = _run_mpirun(config, install)
    if "job" in supervisor.stragglers:  # which ranks held the job back, and by how much
        print(f"horolite-run: {supervisor.stragglers['job']}", file=sys.stderr, flush=True)
    if result.message:
        print(f"horolite-run: {result.message}", file=sys.stderr, flush=True)
    return result.exit_code


def _run_elastic_gloo(parsed) -> int:
    """--gloo with --min-np or a discovery script: survivors of a failure go on in their
    running processes, new workers join at a commit (elastic_gloo.py)."""
    from .elastic_gloo import run_elastic_gloo
    try:
        cfg = elastic_flags.elastic_config(parsed, os.environ, None)
        parsed.num_proc = cfg.num_proc
        config = config_from_args(parsed)
        check_command(config)
        if config.start == SSH:
            hostlib.check_resolvable(config.hosts)
            ssh_check.check_reachable(config)
    except ValueError as e:
        return _error(str(e))
    return run_elastic_gloo(config, cfg)


def _run_mpirun(config: LaunchConfig, install: mpi.MpiInstall):
    argv = mpi.build_mpirun_command(config, install.implementation, install.path,
                                    as_root=(os.geteuid() == 0), wrapper=wrapper_argv(config))
    if config.verbose:
        print(f"horolite-run: {install.version}", file=sys.stderr)
        print(f"horolite-run: {shlex.join(argv)}", file=sys.stderr, flush=True)
    supervisor = Supervisor(argv, config.num_proc,
                            hostlib.rank_hosts(config.hosts, config.num_proc),
                            start_timeout=config.start_timeout, start_help=config.start_help,
                            env=dict(os.environ, **dict(config.mpirun_env)))
    return supervisor, supervisor.run()
