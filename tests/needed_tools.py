"""The programs the tests run besides Python and MPI, and the Debian package of each.

docs/testing.md lists these packages (tests/test_docs.py checks it). A test that needs a
program calls ``missing()`` and skips with its answer, naming the package to install; a
harness whose programs are all here but that does not start fails instead.
"""
import os
import shutil
from typing import Optional

PACKAGES = {
    "unshare": "util-linux", "nsenter": "util-linux",
    "ip": "iproute2", "tc": "iproute2",
    "ssh": "openssh-client", "ssh-keygen": "openssh-client",
    "sshd": "openssh-server",
    "iptables": "iptables",
    "ps": "procps",
    "munged": "munge",
    "slurmctld": "slurm-wlm", "slurmd": "slurm-wlm", "sbatch": "slurm-wlm", "srun": "slurm-wlm",
    "g++": "g++",
}


def find(tool: str) -> Optional[str]:
    """The path of `tool` on PATH or in the sbin folders (root's daemons live there)."""
    return shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin:/usr/bin")


def missing(*tools: str) -> Optional[str]:
    """Why a test that runs `tools` cannot run here (the first absent ones), or None."""
    absent = [t for t in tools if find(t) is None]
    if not absent:
        return None
    packages = sorted({PACKAGES[t] for t in absent})
    return (f"{', '.join(absent)} {'is' if len(absent) == 1 else 'are'} not installed "
            f"(apt-get install {' '.join(packages)})")
