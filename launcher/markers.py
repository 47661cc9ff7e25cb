"""The rank wrappers' marker lines in mpirun's output, and hydra's noise after a failure.

Each rank wrapper (rankwrap.py) and the runtime (horolite/failure/channel.py) write
``##horolite-run## kind field=value ... text=...`` lines; mpirun relays them, bare or
behind its ``[rank]<stderr>:`` prefix. The supervisor's reader threads pick them out.
"""
from __future__ import annotations

import re
from typing import Optional

from .rankwrap import MARKER

__all__ = ["parse_marker", "marker_line", "HYDRA_LINE"]

# hydra's own error stack (``[mpiexec@host] HYDU_sock_write ... Bad file descriptor``...) when
# it is told to stop ranks whose host connection is already gone: noise once a rank has failed.
HYDRA_LINE = re.compile(rb"^\[(mpiexec|proxy:[^\]@]*)@[^\]]*\] ")


def parse_marker(line: str) -> Optional[tuple]:
    """``##horolite-run## exit rank=1 code=3`` -> ("exit", {"rank": "1", "code": "3"}).
    A ``text=`` field comes last and takes the rest of the line (the runtime's markers:
    ``cause``, ``stopped``, ``stall``; see horolite/failure/channel.py)."""
    if not line.startswith(MARKER):
        return None
    line, _, text = line.rstrip("\n").partition(" text=")
    parts = line[len(MARKER):].split()
    if not parts:
        return None
    fields = dict(p.split("=", 1) for p in parts[1:] if "=" in p)
    if text:
        fields["text"] = text
    return parts[0], fields


_RANK_PREFIX = re.compile(rb"^\[\d+\]<std(?:out|err)>:")


def marker_line(raw: bytes) -> Optional[bytes]:
    """The marker in a wrapper's line, or in a rank's own line as the wrapper prefixed it."""
    if raw.startswith(MARKER.encode()):
        return raw
    match = _RANK_PREFIX.match(raw)
    if match and raw[match.end():].startswith(MARKER.encode()):
        return raw[match.end():]
    return None
