"""Rank source: the hosts the user named with ``-H/--hosts`` or ``--hostfile``."""
from __future__ import annotations

from typing import Mapping, Optional

from . import hosts as hostlib
from .rank_source import Ranks

__all__ = ["discover", "SSH_HELP"]

SSH_HELP = "Check that these hosts are reachable (ssh without a password)"


def discover(args, environ: Mapping[str, str]) -> Optional[Ranks]:
    if getattr(args, "hosts", None):
        return Ranks(hostlib.parse_hosts(args.hosts), "the hosts", help=SSH_HELP)
    path = getattr(args, "hostfile", None)
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"cannot read --hostfile {path}: {e.strerror}") from None
    return Ranks(hostlib.parse_hostfile(text, path), f"the hostfile {path}", help=SSH_HELP)
