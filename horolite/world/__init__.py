"""The job's world: who the ranks are and how they reach each other, with MPI or without.

The runtime asks one interface of its world: mpi4py's names, as far as horolite uses
them (ranks and sizes, splits, set-up exchanges of small objects, point-to-point
messages with requests to test and wait on, nonblocking collectives, shared-memory
windows; the list is sockets.py's __all__). Two implementations stand behind it:

* MPI (mpi4py), whenever an MPI launcher started the job, and for a process that
  nobody started as a rank while mpi4py and an MPI library are installed (rank 0 of 1,
  as always);
* horolite's own connections (socket_world.py, MPI's names from sockets.py), when the
  environment says who this rank
  is (identity.py: horolite-run --gloo, Horovod's Gloo names, torchrun and
  PyTorchJob, Kubeflow Trainer, Slurm's srun, TF_CONFIG), or when there is no MPI.
"""
from __future__ import annotations

import os
from typing import Mapping, Optional

__all__ = ["open_world", "reopen", "gloo_timeout", "identity_used"]

DEFAULT_TIMEOUT = 30.0  # horovodrun --gloo-timeout-seconds' default
_identity = None  # where this rank learned who it is (jobs without MPI)
_key_kept: dict = {}  # {identity: the job's key}, once it left the environment


def identity_used():
    """The identity.Identity a job without MPI started from (None over MPI)."""
    return _identity


def gloo_timeout(environ: Mapping[str, str] = os.environ) -> float:
    for name in ("HOROLITE_GLOO_TIMEOUT_SECONDS", "HOROVOD_GLOO_TIMEOUT_SECONDS"):
        raw = environ.get(name, "").strip()
        if raw:
            try:
                value = float(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not a number of seconds") from None
            if value <= 0:
                raise ValueError(f"{name}={raw!r} must be above 0")
            return value
    return DEFAULT_TIMEOUT


def _srun_gave_pmi(environ: Mapping[str, str]) -> bool:
    return any(name in environ for name in ("PMI_RANK", "PMI_SIZE", "PMI_FD", "PMIX_RANK"))


def _mpi_of_size(size: int):
    """mpi4py's MPI if it loads and its world has `size` ranks; else None (srun's PMI is
    one the MPI library does not speak: every task alone, rank 0 of 1)."""
    from ..core import mpi_library
    try:
        names = mpi_library.load_mpi()
    except mpi_library.MPILibraryNotFound:
        return None
    return names if names.COMM_WORLD.Get_size() == size else None


def open_world(environ: Mapping[str, str] = os.environ):
    """What the job's MPI names come from (mpi4py's MPI, or a socket_world.SocketWorld),
    its world started."""
    from ..core import mpi_library
    from . import identity as identity_mod
    if mpi_library.chosen() is not None:
        return mpi_library.chosen()
    from . import generations
    if generations.joining(environ):  # (horolite-run --gloo started it to join a running job)
        wait = generations.JOIN_WAIT_SECONDS
        generations.join(environ, lambda found, generation, superseded: _open_sockets(
            found, environ, generation, superseded, wait))
        return mpi_library.chosen()
    found: Optional[identity_mod.Identity] = identity_mod.from_environ(environ)
    if found is not None and found.source.startswith("Slurm") and _srun_gave_pmi(environ):
        names = _mpi_of_size(found.size)  # srun --mpi=pmi2: an MPI job, as always
        if names is not None:
            mpi_library.use(names)
            return names
    if found is None:
        try:
            names = mpi_library.load_mpi()
        except mpi_library.MPILibraryNotFound:
            if identity_mod.under_mpi_launcher(environ):
                raise
            found = identity_mod.Identity(0, 1, 0, 1, "", 0, "no MPI and no launcher: 1 rank",
                                          False, None)
        else:
            mpi_library.use(names)
            return names
    return _open_sockets(found, environ)


def _open_sockets(found, environ: Mapping[str, str], generation: int = 0, superseded=None,
                  timeout: Optional[float] = None, before=None):
    """A SocketWorld met as `found` says, which the runtime holds from then on."""
    global _identity
    from . import generations
    from . import identity as identity_mod
    from . import socket_world
    from ..core import mpi_library
    from ..core.settings import env_value
    settings_iface = env_value("TCP_IFACE", environ) or env_value("GLOO_IFACE", environ) or ""
    key = None
    if found.size > 1 or generation:
        key = identity_mod.job_key(environ) or _key_kept.get(found)
    worker = generations.worker(environ) or ""
    world = socket_world.open_world(found, key,
                                    gloo_timeout(environ) if timeout is None else timeout,
                                    settings_iface, generation, superseded, worker, before)
    mpi_library.use(world)
    _identity = found
    if key is not None and not worker:
        _forget_key(found, key, environ)
    return world


def _forget_key(found, key: bytes, environ: Mapping[str, str]) -> None:
    """Once the ranks met, the key leaves the environment: processes the script starts
    later do not inherit it. This process keeps it (a later init() of the same job);
    an elastic worker's stays, for the launcher's later generations to be read with."""
    _key_kept[found] = key
    if environ is os.environ:
        os.environ.pop("HOROLITE_JOB_KEY", None)


def reopen(found, generation: int, superseded=None, environ: Mapping[str, str] = os.environ):
    """Between two generations of an elastic job without MPI (after shutdown()): close
    this world's connections and meet the ranks of generation `generation` as `found`
    says. The rendezvous this process serves, if any, stays. Called again after a
    generation that did not form: the world before (still the one the runtime holds)
    hands the next what it kept."""
    from ..core import mpi_library
    before = mpi_library.chosen()
    before.close(keep_server=True)
    return _open_sockets(found, environ, generation, superseded, before=before)
