"""This process's place in an elastic job, read once from what horolite-run set.

None outside horolite-run's elastic mode: then commits stay in memory and no host
update ever arrives, as with Horovod's elastic code run by a plain launcher.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import socket
from typing import Optional

from . import protocol

__all__ = ["Session", "current", "log"]

log = logging.getLogger("horolite.elastic")


@dataclasses.dataclass(frozen=True)
class Session:
    job: str
    generation: int
    notify: str
    seen: int
    host: str

    def commit_dir(self) -> str:
        return protocol.host_dir(self.job, self.host)


_session: Optional[Session] = None
_read = False


def current() -> Optional[Session]:
    global _session, _read
    if not _read:
        _read = True
        job = os.environ.get(protocol.JOB, "")
        if job:
            _session = Session(job=job,
                               generation=int(os.environ.get(protocol.GENERATION, "0") or 0),
                               notify=os.environ.get(protocol.NOTIFY, ""),
                               seen=int(os.environ.get(protocol.SEEN, "0") or 0),
                               host=socket.gethostname())
    return _session
