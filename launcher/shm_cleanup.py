"""Shared-memory files the job leaves in /dev/shm when it ends abnormally.

The MPI library (MPICH's ``mpich_shm_*``, Open MPI's ``vader``/``sm`` segments) and
anything else the ranks map from /dev/shm are unlinked at a clean MPI_Finalize, and
left behind (megabytes each) by a rank that is killed or skips it. Only files that
the job's own processes had mapped are ever removed: the supervisor reads
``/proc/<pid>/maps`` of every process below its mpirun while the job runs, and
removes those created after the job started, so another job's segments on the same
host are never touched. Ranks also report their files themselves right after ``init()``
(horolite/failure/shm_files.py), so a job that fails between two samples loses nothing.
"""
from __future__ import annotations

import os
import time
from typing import Iterable, List, Set

from horolite.failure.shm_files import SHM_DIR, mapped_shm_files

__all__ = ["ShmLeftovers"]


class ShmLeftovers:
    """The job's /dev/shm files seen so far, and their removal once the job is over."""

    def __init__(self):
        self.seen: Set[str] = set()
        self.started = time.time()

    def scan(self, pids: Iterable[int]) -> None:
        for pid in list(pids):
            self.seen |= mapped_shm_files(pid)

    def reported(self, paths: Iterable[str]) -> None:
        """Files a rank on this host said it maps (its ``shm`` marker, horolite/failure/shm_files.py)."""
        self.seen |= {p for p in paths if p.startswith(SHM_DIR)}

    def remove_leftovers(self) -> List[str]:
        """Unlink the files still there (the job's processes are gone); returns them."""
        removed = []
        for path in sorted(self.seen):
            if os.path.dirname(path) + "/" != SHM_DIR or ".." in path:
                continue
            try:
                info = os.stat(path)
                if info.st_uid != os.getuid() or info.st_ctime < self.started - 1:
                    continue  # made before this job (another program's, shared with it)
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass
        return removed
