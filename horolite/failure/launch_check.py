"""Refuse to start N separate trainings: the launcher says N processes, MPI says 1.

``srun`` without working PMI wiring (and an ``mpirun`` of another MPI than the
one mpi4py loaded) starts every process as an MPI singleton, "rank 0 of 1".
Each would train its own model without a word. The launchers leave their count
in the environment; when the innermost one says N > 1 and MPI's world has one
process, ``init()`` raises LaunchMismatchError saying so and how to fix it.
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional

__all__ = ["LaunchMismatchError", "LAUNCHERS", "mismatch", "check"]


class LaunchMismatchError(RuntimeError):
    """The launcher started several processes but MPI sees each one alone."""


_SAME_MPI = ("mpi4py's MPI library ({library}) is not the MPI whose launcher started this "
             "process: launch with horolite-run (it uses the mpirun of the installed MPI wheel), "
             "or with the mpirun of the MPI mpi4py loaded")
_SRUN_PMIX = ("srun did not connect this process to MPI, so every task would train its own model: "
              "Open MPI 5 ({library}) speaks only PMIx to srun, so use `srun --mpi=pmix ...` where "
              "Slurm has its PMIx plugin; or run `horolite-run python ...` inside the allocation "
              "(sbatch/salloc) instead of srun")
_SRUN_PMI2 = ("srun did not connect this process to MPI (no PMI, or one the MPI library does not "
              "speak), so every task would train its own model: with the MPICH wheel ({library}) "
              "use `srun --mpi=pmi2 ...` (or SLURM_MPI_TYPE=pmi2, or MpiDefault=pmi2 in "
              "slurm.conf); or run `horolite-run python ...` inside the allocation (sbatch/salloc) "
              "instead of srun")

# (size variable, rank variable, who sets them), innermost launcher first: a rank started by
# mpiexec inside an srun step sees both, and mpiexec's count is the one for MPI.
LAUNCHERS = (
    ("PMI_SIZE", "PMI_RANK", "MPICH's mpiexec (hydra) or srun --mpi=pmi2"),
    ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "Open MPI's mpirun"),
    ("SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "Slurm's srun"),
)


def _fix(size: int, environ: Mapping[str, str], library: str) -> str:
    if environ.get("SLURM_STEP_NUM_TASKS", "").strip() == str(size):  # srun started it
        return (_SRUN_PMIX if "Open MPI" in library else _SRUN_PMI2).format(library=library)
    return _SAME_MPI.format(library=library)


def mismatch(world_size: int, environ: Mapping[str, str], library: str = "unknown") -> Optional[str]:
    """Why this launch is broken, or None when MPI's world agrees with the launcher."""
    if world_size != 1:
        return None
    for size_var, rank_var, who in LAUNCHERS:
        text = environ.get(size_var, "").strip()
        if not text.isdigit():
            continue
        size = int(text)
        if size <= 1:
            return None
        rank = environ.get(rank_var, "?")
        return (f"{who} started {size} processes ({size_var}={size}; this is {rank_var}={rank}) "
                f"but MPI initialized this one alone, as rank 0 of 1. "
                f"{_fix(size, environ, library)}. (If this process is meant to run alone, "
                f"unset {size_var}.)")
    return None


def check(world_size: int, environ: Mapping[str, str], library: Callable[[], str]) -> None:
    """Raise LaunchMismatchError when the launcher and MPI disagree (see ``mismatch``)."""
    if world_size == 1:
        message = mismatch(world_size, environ, _first_line(library))
        if message:
            raise LaunchMismatchError(message)


def _first_line(library: Callable[[], str]) -> str:
    try:
        return library().strip().splitlines()[0].strip()
    except Exception:  # only decorates the message
        return "unknown"
