"""This host's process table, and how mpirun is started so that it dies with the launcher.

The supervisor remembers the processes mpirun started here (with their start
times, so a reused pid is never killed) and kills what is left after a failed job.
"""
from __future__ import annotations

import os
import signal
import sys
from typing import Dict, List, Optional

__all__ = ["proc_table", "descendants", "set_session_and_parent_death"]


def proc_table() -> Dict[int, tuple]:
    """pid -> (ppid, start time) for every process, from /proc (empty where there is none)."""
    table = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return table
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()
        table[int(name)] = (int(fields[1]), fields[19])  # ppid, starttime
    return table


def descendants(root: int, table: Optional[Dict[int, tuple]] = None) -> Dict[int, bytes]:
    """pid -> start time of every process below ``root``."""
    table = proc_table() if table is None else table
    children: Dict[int, List[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            found[child] = table[child][1]
            todo.append(child)
    return found


def set_session_and_parent_death():  # in mpirun's process, between fork and exec
    os.setsid()
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
        except Exception:
            pass
