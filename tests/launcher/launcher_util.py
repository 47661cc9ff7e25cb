"""Helpers shared by the launcher's end-to-end tests (process table, mark files)."""
import json
import os
import subprocess
import time

import pytest

import needed_tools

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROBE = os.path.join(REPO, "tests", "launcher_rank", "probe.py")
HANG_SSH = os.path.join(REPO, "tests", "launcher_rank", "hang_ssh.sh")


def marks(outdir):
    """rank -> the mark file each rank of a probe run wrote."""
    found = {}
    for name in os.listdir(outdir):
        if name.endswith(".json"):
            with open(os.path.join(outdir, name)) as f:
                found[int(name[:-5])] = json.load(f)
    return found


def processes_with(token):
    """Lines of the process table whose command line contains ``token``."""
    if needed_tools.missing("ps"):
        pytest.skip(needed_tools.missing("ps"))
    out = subprocess.run(["ps", "-ww", "-eo", "pid,ppid,stat,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines()[1:] if token in line and "ps -eo" not in line
            and " Z " not in line and not line.split()[2].startswith("Z")]


def wait_until_gone(token, seconds):
    deadline = time.monotonic() + seconds
    left = processes_with(token)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = processes_with(token)
    return left


def wait_for_marks(outdir, count, seconds=30, read=None):
    """Whether `count` ranks left their marks within `seconds` (read: how to read them)."""
    read = read or marks
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if len(read(outdir)) >= count:
            return True
        time.sleep(0.1)
    return False
