"""Which MPI is installed, and the exact mpirun command line for it.

``build_mpirun_command`` is pure: it turns a LaunchConfig into argv for one
MPI implementation, so every flag is unit-tested without running anything.
Every flag used here was checked against the real binaries of the two wheels
(MPICH 5 hydra ``mpiexec``, Open MPI 5 ``prterun``); nothing like
``-bind-to none`` that Open MPI 5 rejects.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from typing import List, Optional, Sequence

from .rank_source import SLURM

__all__ = ["MPICH", "OPENMPI", "MpiInstall", "NoMPIError", "find_mpirun", "detect_implementation",
           "find_mpi", "build_mpirun_command"]

MPICH = "mpich"
OPENMPI = "openmpi"

NO_MPI_HELP = ('no MPI found (no mpirun): pip install "horolite[mpich]" (or "horolite[openmpi]"), '
               "or put your site MPI's mpirun on PATH (HOROLITE_MPIRUN=/path/to/mpirun picks a "
               "specific one); or run without MPI: horolite-run --gloo ...")


class NoMPIError(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class MpiInstall:
    path: str
    implementation: str  # MPICH or OPENMPI
    version: str  # first line of `mpirun --version`, or the hydra version


def find_mpirun(environ=None, executable: Optional[str] = None) -> Optional[str]:
    """HOROLITE_MPIRUN, else mpirun next to the Python interpreter (the wheel's bin), else PATH."""
    environ = os.environ if environ is None else environ
    explicit = environ.get("HOROLITE_MPIRUN")
    if explicit:
        return shutil.which(explicit)
    bindir = os.path.dirname(executable or sys.executable)
    for name in ("mpirun", "mpiexec"):
        found = shutil.which(name, path=bindir)
        if found:
            return found
    for name in ("mpirun", "mpiexec"):
        found = shutil.which(name, path=environ.get("PATH", os.defpath))
        if found:
            return found
    return None


def detect_implementation(version_text: str) -> Optional[str]:
    """MPICH or OPENMPI from the text of ``mpirun --version``; None if neither."""
    if "HYDRA" in version_text or "MPICH" in version_text or "Intel(R) MPI" in version_text:
        return MPICH
    if "Open MPI" in version_text or "OpenRTE" in version_text or "PRRTE" in version_text \
            or "prterun" in version_text:
        return OPENMPI
    return None


def _short_version(impl: str, text: str) -> str:
    for line in text.splitlines():
        line = line.strip()
        if impl == MPICH and line.startswith("Version:"):
            return "MPICH hydra " + line.split(":", 1)[1].strip()
        if impl == OPENMPI and line:
            return line
    return text.strip().splitlines()[0] if text.strip() else "unknown version"


def find_mpi(environ=None) -> MpiInstall:
    """The installed mpirun and its implementation; NoMPIError with install advice otherwise."""
    path = find_mpirun(environ)
    if path is None:
        raise NoMPIError(NO_MPI_HELP)
    try:
        proc = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NoMPIError(f"{path} --version failed ({e}); {NO_MPI_HELP}") from None
    text = proc.stdout + proc.stderr
    impl = detect_implementation(text)
    if impl is None:
        raise NoMPIError(f"{path} is neither MPICH (hydra) nor Open MPI: `{path} --version` said "
                         f"{text.strip()[:200]!r}")
    return MpiInstall(path=path, implementation=impl, version=_short_version(impl, text))


def _used_hosts(config):
    """The hosts given; inside a Slurm allocation only those the ranks fill (srun starts
    daemons on every host named, so an unused node would still get one)."""
    if config.start != SLURM:
        return config.hosts
    used, left = [], config.num_proc
    for name, slots in config.hosts:
        if left <= 0:
            break
        used.append((name, min(slots, left)))
        left -= min(slots, left)
    return tuple(used)


def build_mpirun_command(config, impl: str, mpirun: str = "mpirun", *, as_root: bool = False,
                         wrapper: Sequence[str] = ()) -> List[str]:
    """The argv that launches ``config.command`` on ``config.num_proc`` ranks.

    ``wrapper`` is the per-rank wrapper prefix (python rankwrap.py ... --); each
    rank runs ``wrapper + command``.
    """
    cmd: List[str] = [mpirun]
    hosts = _used_hosts(config)
    set_env = [(k, v) for k, v in config.env if v is not None]
    pass_env = [k for k, v in config.env if v is None]
    if impl == MPICH:
        cmd += ["-np", str(config.num_proc)]
        if config.start == SLURM:  # hydra starts its proxies with srun, not ssh
            cmd += ["-launcher", "slurm"]
        if hosts:
            cmd += ["-hosts", ",".join(f"{h}:{n}" for h, n in hosts)]
        for name, value in set_env:
            cmd += ["-genv", name, value]
        if pass_env:
            # Not -genvlist: with it hydra gives ranks on other hosts only the listed
            # variables (no PATH, no VIRTUAL_ENV). Every variable of this environment
            # travels, the -x ones included.
            cmd += ["-genvall"]
        if config.network_interface:
            cmd += ["-iface", config.network_interface]
        if config.ssh_args:
            # Hydra's ssh launcher takes extra ssh options only from its environment.
            cmd = ["env", f"HYDRA_LAUNCHER_EXTRA_ARGS={config.ssh_args}"] + cmd + ["-launcher", "ssh"]
    elif impl == OPENMPI:
        cmd += ["-np", str(config.num_proc)]
        if as_root:
            cmd += ["--allow-run-as-root"]
        # More ranks than cores (or than a host's slots) is allowed, as with MPICH.
        cmd += ["--oversubscribe"]
        if config.start == SLURM:  # PRRTE starts its daemons with srun, not ssh
            cmd += ["--prtemca", "plm", "slurm"]
        if hosts:
            cmd += ["--host", ",".join(f"{h}:{n}" for h, n in hosts)]
            # With --oversubscribe, Open MPI 5's default mapping (by core) puts every rank on
            # the first host while it has cores; fill each host's slots in order instead.
            if not any(a in ("--map-by", "-map-by") for a in config.mpi_args):
                cmd += ["--map-by", "slot"]
        for name, value in set_env:
            cmd += ["-x", f"{name}={value}"]
        for name in pass_env:
            cmd += ["-x", name]
        if config.network_interface:
            cmd += ["--mca", "btl_tcp_if_include", config.network_interface,
                    "--mca", "oob_tcp_if_include", config.network_interface]
        if config.ssh_args:
            cmd += ["--mca", "plm_ssh_args", config.ssh_args]
    else:
        raise ValueError(f"unknown MPI implementation {impl!r} (expected {MPICH!r} or {OPENMPI!r})")
    cmd += list(config.binding_args)
    cmd += list(config.mpi_args)
    cmd += list(wrapper)
    cmd += list(config.command)
    return cmd
