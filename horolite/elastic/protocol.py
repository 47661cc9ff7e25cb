"""What horolite-run's elastic driver and the ranks agree on: variables, paths, markers.

Standard library only: the launcher imports it too. The driver starts every
generation of the job (the first start and every restart) with these variables
set on each rank; a rank without them runs its elastic code as a plain job
(commits stay in memory, no host updates), as under a bare ``mpirun``.
"""
from __future__ import annotations

import os
import tempfile
from typing import Optional, Tuple

__all__ = ["JOB", "GENERATION", "NOTIFY", "SEEN", "MARKER_KIND", "commit_root", "job_dir",
           "host_dir", "read_update", "write_update"]

JOB = "HOROLITE_ELASTIC_JOB"  # id of the elastic job: the same across its restarts
GENERATION = "HOROLITE_ELASTIC_GENERATION"  # 0 for the first start, then 1, 2, ...
NOTIFY = "HOROLITE_ELASTIC_NOTIFY"  # host-update file on the driver's host
SEEN = "HOROLITE_ELASTIC_SEEN"  # the update number this generation was started with
COMMIT_DIR = "HOROLITE_ELASTIC_COMMIT_DIR"  # where commits go (default /dev/shm)
VARIABLES = (JOB, GENERATION, NOTIFY, SEEN, COMMIT_DIR)

MARKER_KIND = "elastic"  # ``##horolite-run## elastic event=... rank=... text=...``
RESET = "reset"  # every rank leaves so that the job restarts on the new host set
USER_ERROR = "user-error"  # the training code raised: the job ends, it is not restarted


def commit_root(environ=None) -> str:
    environ = os.environ if environ is None else environ
    if environ.get(COMMIT_DIR):
        return environ[COMMIT_DIR]
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def job_dir(job: str, environ=None) -> str:
    """Every commit of one job on one machine (removed by the driver at the end)."""
    return os.path.join(commit_root(environ), f"horolite-elastic-{job}")


def host_dir(job: str, host: str, environ=None) -> str:
    """The commits of this host's ranks: named by host, so that simulated hosts sharing
    one /dev/shm still keep apart what each would hold in its own memory."""
    return os.path.join(job_dir(job, environ), host)


def read_update(path: Optional[str]) -> Tuple[int, int]:
    """(update number, 1 if only hosts were removed) from the driver's file; (0, 0) when
    there is none here (this rank is not on the driver's host)."""
    if not path:
        return 0, 0
    try:
        with open(path, encoding="ascii") as f:
            number, removed = f.read().split()[:2]
        return int(number), int(removed)
    except (OSError, ValueError):
        return 0, 0


def write_update(path: str, number: int, removed_only: bool) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="ascii") as f:
        f.write(f"{number} {int(removed_only)}\n")
    os.replace(tmp, path)
