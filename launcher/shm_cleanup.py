"""Shared-memory files the job leaves in /dev/shm when it ends abnormally.

The MPI library (MPICH's ``mpich_shm_*``, Open MPI's ``vader``/``sm`` segments) and
anything else the ranks map from /dev/shm are unlinked at a clean MPI_Finalize, and
left behind (megabytes each) by a rank that is killed or skips it. Only files that
the job's own processes had mapped are ever removed: the supervisor reads
``/proc/<pid>/maps`` of every process below its mpirun while the job runs, and
removes those created after the job started, so another job's segments on the same
host are never touched. Ranks also report their files themselves right after ``init()``
(horolite/failure/shm_files.py), so a job that fails between two samples loses nothing.

The ranks on other hosts report theirs the same way (their lines come back through
mpirun). After a failed job those are removed on their own host, through the way
mpirun reached it (ssh, with mpirun's ssh options; under Slurm, srun into the job's
allocation), by a short Python program that makes the same checks there: a file under
/dev/shm, owned by this user, made since the job started.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import threading
import time
from typing import Dict, Iterable, List, Optional, Sequence, Set

from horolite.failure.shm_files import SHM_DIR, mapped_shm_files

__all__ = ["ShmLeftovers", "remote_command"]

# Seconds a remote removal may take (ssh, or srun, plus Python starting there).
REMOTE_SECONDS = 20.0
# Another host's clock may differ from ours: a file made this much before the job
# started (as we count) still counts as the job's. Names carry random parts, so an
# older file of the same name is not expected anyway.
CLOCK_SKEW = 300.0
# Run on the other host: remove the files given that pass the checks, print them.
_REMOVE = """
import os, sys
since = float(sys.argv[1])
for path in sys.argv[2:]:
    if os.path.dirname(path) != "/dev/shm" or ".." in path:
        continue
    try:
        info = os.stat(path)
        if info.st_uid == os.getuid() and info.st_ctime >= since:
            os.unlink(path)
            print(path)
    except OSError:
        pass
"""


class ShmLeftovers:
    """The job's /dev/shm files seen so far, and their removal once the job is over."""

    def __init__(self):
        self.seen: Set[str] = set()
        self.remote: Dict[str, Set[str]] = {}  # host -> files its ranks reported
        self.started = time.time()

    def scan(self, pids: Iterable[int]) -> None:
        for pid in list(pids):
            self.seen |= mapped_shm_files(pid)

    def reported(self, paths: Iterable[str], host: Optional[str] = None) -> None:
        """Files a rank said it maps (its ``shm`` marker, horolite/failure/shm_files.py):
        on this host, or on `host`."""
        paths = {p for p in paths if p.startswith(SHM_DIR)}
        if host is None:
            self.seen |= paths
        elif paths:
            self.remote.setdefault(host, set()).update(paths)

    def remove_remote(self, mpirun_argv: Sequence[str]) -> Dict[str, List[str]]:
        """Unlink the other hosts' reported files still there, each on its host, the way
        `mpirun_argv` reaches it; {host: files removed}. Hosts answer in parallel; one
        that cannot be reached within REMOTE_SECONDS is skipped."""
        removed: Dict[str, List[str]] = {}

        def clean(host, paths):
            command = [sys.executable, "-c", _REMOVE, f"{self.started - CLOCK_SKEW:.3f}",
                       *sorted(paths)]
            argv = remote_command(mpirun_argv, host)
            # ssh hands the remote shell one string; srun runs the argv as it is
            argv += [shlex.join(command)] if argv[0] == "ssh" else command
            try:
                done = subprocess.run(argv, capture_output=True, text=True,
                                      timeout=REMOTE_SECONDS, stdin=subprocess.DEVNULL)
            except (OSError, subprocess.TimeoutExpired):
                return
            if done.returncode == 0:
                removed[host] = [p for p in done.stdout.split() if p in paths]

        threads = [threading.Thread(target=clean, args=item, daemon=True)
                   for item in self.remote.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(REMOTE_SECONDS + 5)
        return {h: p for h, p in removed.items() if p}

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


def remote_command(mpirun_argv: Sequence[str], host: str) -> List[str]:
    """The prefix that runs a command on `host` as mpirun started the ranks there: srun
    into the allocation when it used Slurm, else ssh with the options it was given."""
    argv = list(mpirun_argv)
    slurm = any(a == "-launcher" and b == "slurm" for a, b in zip(argv, argv[1:])) or \
        any(a in ("plm", "plm_slurm") and b == "slurm" for a, b in zip(argv, argv[1:]))
    if slurm:
        return ["srun", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={host}",
                "--quiet"]
    extra: List[str] = []
    for a in argv:
        if a.startswith("HYDRA_LAUNCHER_EXTRA_ARGS="):
            extra = a.split("=", 1)[1].split()
    for a, b in zip(argv, argv[1:]):
        if a in ("plm_ssh_args", "--ssh-args"):  # Open MPI's; --gloo's rank_spawn.py
            extra = b.split()
    return ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", *extra, host]
