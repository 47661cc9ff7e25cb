"""The /dev/shm files this process maps, told to horolite-run for removal after a failure.

The MPI library's segments (MPICH's ``mpich_shm_*``, Open MPI's ``vader``/``sm``) and
horolite's shared-memory window are unlinked at a clean MPI_Finalize and left behind,
megabytes each, by a rank that is killed or skips it. horolite-run also samples the
ranks' ``/proc/<pid>/maps`` while the job runs, but a job that fails within its first
second can end between two samples; the rank's own report right after ``init()``
cannot be missed (launcher/shm_cleanup.py).

Under plain mpirun or srun there is no horolite-run to do it, so a rank that ends
because the job cannot go on (remove_mapped, on its way out before os._exit) unlinks
the files it maps itself: the job's other ranks on the host keep their mappings, and
every one of them maps the host's MPICH segment, so the first to go removes it.
"""
from __future__ import annotations

import os
import socket
from typing import Set

__all__ = ["mapped_shm_files", "report_to_launcher", "remove_mapped"]

SHM_DIR = "/dev/shm/"


def mapped_shm_files(pid: int) -> Set[str]:
    """Paths under /dev/shm that process `pid` has mapped (empty if it is gone)."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            text = f.read()
    except OSError:
        return set()
    if SHM_DIR.encode() not in text:
        return set()
    found = set()
    for line in text.splitlines():
        at = line.find(SHM_DIR.encode())
        if at >= 0:
            path = line[at:].decode(errors="replace")
            if path.endswith(" (deleted)") or " " in path:
                continue  # already unlinked, or a name the marker line could not carry
            found.add(path)
    return found


def report_to_launcher(rank: int) -> None:
    from .channel import launcher_marker  # only acts under horolite-run's rank wrapper
    paths = mapped_shm_files(os.getpid())
    if paths:
        launcher_marker("shm", rank=rank, host=socket.gethostname(), text=" ".join(sorted(paths)))


def remove_mapped() -> None:
    """Unlink the /dev/shm files this process maps (its job is over: see above)."""
    for path in sorted(mapped_shm_files(os.getpid())):
        try:
            os.unlink(path)
        except OSError:
            pass
