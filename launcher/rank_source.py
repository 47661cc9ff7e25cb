"""The interface of a rank source: what a source of hosts reports to the launcher.

A source is a module with ``discover(args, environ) -> Optional[Ranks]``
(``args``: the parsed ``horolite-run`` flags). ``sources.py`` asks them in order.
"""
from __future__ import annotations

import dataclasses
from typing import Tuple

from .hosts import Host

__all__ = ["SSH", "SLURM", "Ranks"]

SSH = "ssh"  # mpirun reaches other hosts its usual way (ssh; fork on this host)
SLURM = "slurm"  # mpirun starts its daemons with srun inside the Slurm allocation


@dataclasses.dataclass(frozen=True)
class Ranks:
    hosts: Tuple[Host, ...]  # (name, slots); empty: this host only
    origin: str  # what they came from, for messages: "the hosts", "the Slurm allocation (...)"
    start: str = SSH  # how mpirun starts processes on the hosts: SSH or SLURM
    help: str = ""  # what to check when ranks do not start in time
    mpirun_env: Tuple[Tuple[str, str], ...] = ()  # set for mpirun itself (not the ranks' settings)
