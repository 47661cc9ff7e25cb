"""Where the ranks come from: the first source that finds hosts wins.

What the user gave (``-H``, ``--hostfile``) beats what the environment says
(a Slurm allocation, the Kubernetes MPI Operator's hostfile); none means
"this host only". A new source (another scheduler) is a new module with
``discover(args, environ)`` (see ``rank_source.py``) and one entry in SOURCES.
"""
from __future__ import annotations

from typing import Mapping, Optional

from . import host_flags, mpi_operator, slurm
from .rank_source import Ranks

__all__ = ["SOURCES", "DISCOVER", "discover"]

SOURCES = (host_flags, slurm, mpi_operator)
DISCOVER = object()  # "ask the sources" (a default argument of main.config_from_args)


def discover(args, environ: Mapping[str, str]) -> Optional[Ranks]:
    """The hosts of this job from the first source that has them; None: this host only."""
    for source in SOURCES:
        found = source.discover(args, environ)
        if found is not None:
            return found
    return None
