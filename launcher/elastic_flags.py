"""horovodrun's elastic flags, with Horovod 0.28.1's names, destinations and meaning.

A job is elastic when it has ``--host-discovery-script`` or ``--min-np`` (as for
horovodrun); the other elastic flags then apply, and without either they are an
error (horovodrun ignores them silently).
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Mapping, Optional, Tuple

from . import flags

__all__ = ["add_elastic_flags", "is_elastic", "ElasticConfig", "elastic_config"]

_ONLY_ELASTIC = ("max_num_proc", "slots", "elastic_timeout", "reset_limit", "cooldown_range")


def _positive(text):
    value = flags.non_negative(int)(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def add_elastic_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "elastic training (by restart: a failed rank or a new host set restarts the job from "
        "the last commit; see docs/elastic.md)")
    g.add_argument("--min-np", "--min-num-proc", dest="min_num_proc", type=_positive,
                   help="fewest ranks to go on with after a failure; makes the job elastic "
                        "(default: -np)")
    g.add_argument("--max-np", "--max-num-proc", dest="max_num_proc", type=_positive,
                   help="most ranks to use when more slots are available (default: no limit)")
    g.add_argument("--slots-per-host", dest="slots", type=_positive,
                   help="slots of a host the discovery script prints without ':slots'")
    g.add_argument("--elastic-timeout", dest="elastic_timeout", type=flags.non_negative(float),
                   help="seconds to wait for --min-np slots before failing (default 600, or "
                        "HOROLITE_ELASTIC_TIMEOUT / HOROVOD_ELASTIC_TIMEOUT)")
    g.add_argument("--reset-limit", dest="reset_limit", type=flags.non_negative(int),
                   help="most restarts (after failures or host changes) before the job fails "
                        "(default: no limit)")
    g.add_argument("--blacklist-cooldown-range", dest="cooldown_range", type=_positive, nargs=2,
                   metavar=("MIN", "MAX"),
                   help="a failed host comes back after MIN*2^n+uniform(0,MIN) seconds kept in "
                        "[MIN, MAX] (n: its n-th failure); default: blacklisted for good")
    g.add_argument("--host-discovery-script", metavar="SCRIPT",
                   help="run about every second; prints the available hosts, one 'host:slots' "
                        "(or 'host') per line; makes the job elastic")


def is_elastic(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "host_discovery_script", None)) or \
        getattr(args, "min_num_proc", None) is not None


@dataclasses.dataclass(frozen=True)
class ElasticConfig:
    num_proc: int  # ranks needed for the first start
    min_np: int  # ranks needed to go on after a reset
    max_np: Optional[int]
    timeout: float
    reset_limit: Optional[int]
    cooldown: Optional[Tuple[int, int]]
    script: Optional[str]
    slots_per_host: Optional[int]


def check_not_elastic(args: argparse.Namespace) -> None:
    """ValueError when an elastic-only flag is given to a job that is not elastic."""
    for dest in _ONLY_ELASTIC:
        if getattr(args, dest, None) is not None:
            flag = {"slots": "--slots-per-host", "cooldown_range": "--blacklist-cooldown-range",
                    "max_num_proc": "--max-np"}.get(dest, "--" + dest.replace("_", "-"))
            raise ValueError(f"{flag} applies to elastic jobs only: add --min-np N or "
                             "--host-discovery-script SCRIPT")


def elastic_config(args: argparse.Namespace, environ: Mapping[str, str],
                   pool_slots: Optional[int]) -> ElasticConfig:
    """The elastic numbers from the flags; `pool_slots`: the slots of -H/--hostfile/Slurm."""
    num_proc = args.num_proc or args.min_num_proc or pool_slots
    if not num_proc:
        raise ValueError("give the number of ranks to start with: -np N (or --min-np N)")
    min_np = args.min_num_proc or num_proc
    if min_np > num_proc:
        raise ValueError(f"--min-np {min_np} is more than -np {num_proc}")
    if args.max_num_proc is not None and args.max_num_proc < num_proc:
        raise ValueError(f"--max-np {args.max_num_proc} is less than -np {num_proc}")
    timeout = flags.launcher_value("ELASTIC_TIMEOUT", args.elastic_timeout, environ, 600.0)
    cooldown = tuple(args.cooldown_range) if args.cooldown_range else None
    return ElasticConfig(num_proc=num_proc, min_np=min_np, max_np=args.max_num_proc,
                         timeout=timeout, reset_limit=args.reset_limit, cooldown=cooldown,
                         script=args.host_discovery_script, slots_per_host=args.slots)
