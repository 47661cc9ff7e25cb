"""What this install can do: Horovod's *_built / *_enabled queries.

On the host a job talks MPI (mpi4py) when an MPI launcher started it, and
horolite's own connections otherwise (Horovod's "Gloo" mode: horolite-run --gloo,
srun, torchrun-style schedulers); GPU memory goes over NCCL when CuPy with NCCL is
installed (the `cuda` extra). There is no DDL, oneCCL or ROCm path. None of these
needs init() except the *_enabled ones, as in Horovod.
"""
from __future__ import annotations

import importlib.util

from ..core.mpi_library import without_mpi
from . import basics

__all__ = ["mpi_built", "mpi_enabled", "gloo_built", "gloo_enabled", "nccl_built", "cuda_built",
           "rocm_built", "ddl_built", "ccl_built"]


def mpi_built() -> bool:
    return importlib.util.find_spec("mpi4py") is not None


def mpi_enabled() -> bool:
    """True once init() has started the runtime over MPI."""
    return basics.is_initialized() and not without_mpi()


def gloo_built() -> bool:
    """Always: jobs without MPI run on horolite's own connections (no extra needed)."""
    return True


def gloo_enabled() -> bool:
    """True once init() has started the runtime without MPI (Horovod's Gloo mode)."""
    return basics.is_initialized() and without_mpi()



def cuda_built() -> bool:
    """True when CuPy is installed, so GPU arrays can be reduced (with a GPU present)."""
    return importlib.util.find_spec("cupy") is not None


def nccl_built() -> bool:
    """True when CuPy's NCCL bindings load (nvidia-nccl-cu12); a GPU is not needed to ask."""
    if not cuda_built():
        return False
    try:
        from cupy.cuda import nccl
    except Exception:  # CuPy present but its CUDA libraries are not: no NCCL either
        return False
    return bool(getattr(nccl, "available", False))


def rocm_built() -> bool:
    return False


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False
