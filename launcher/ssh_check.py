"""Before a multi-host job starts: can every remote host be reached with ssh, without a password?

mpirun starts its daemons on other hosts through ssh. When one cannot be
reached it prints a stack of launcher errors (or waits for a timeout); one ssh
per remote host, all at once, says which host and why before anything starts,
as horovodrun does. The user's own ssh configuration is used unchanged.
"""
from __future__ import annotations

import shlex
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from typing import List, Sequence, Tuple

from . import hosts as hostlib

__all__ = ["unreachable", "check_reachable"]

# Arguments that make mpirun start remote daemons some other way than ssh (Slurm, rsh...).
_OTHER_LAUNCHERS = ("-launcher", "-bootstrap", "-rmk", "plm", "--launch-agent", "-launcher-exec")


def _probe(host: str, timeout: float, options: Sequence[str] = ()) -> Tuple[str, str]:
    argv = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={int(max(1, timeout))}",
            *options, host, "true"]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout + 5,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return host, f"ssh {host} did not answer within {timeout + 5:g}s"
    if proc.returncode == 0:
        return host, ""
    lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
    return host, lines[-1] if lines else f"ssh {host} true exited with code {proc.returncode}"


def unreachable(hosts: Sequence[str], timeout: float = 10.0,
                options: Sequence[str] = ()) -> List[Tuple[str, str]]:
    """(host, ssh's reason) for each host that ssh cannot log in to without a password."""
    if not hosts:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        results = list(pool.map(lambda h: _probe(h, timeout, options), hosts))
    return [(host, why) for host, why in results if why]


def check_reachable(config, timeout: float = 10.0) -> None:
    """ValueError naming every remote host of the job that ssh cannot reach, and why."""
    remote = [name for name, _ in config.hosts if not hostlib.is_local(name)]
    if not remote or shutil.which("ssh") is None or \
            any(arg.startswith(_OTHER_LAUNCHERS) for arg in config.mpi_args):
        return
    failed = unreachable(remote, timeout, shlex.split(getattr(config, "ssh_args", "")))  # -p, -i
    if failed:
        detail = "; ".join(f"{host}: {why}" for host, why in failed)
        raise ValueError(f"cannot reach {len(failed)} of {len(remote)} remote host(s) with ssh "
                         f"({detail}). Ranks on other hosts start through ssh: each host needs "
                         f"an sshd and a key that logs in without a password")
