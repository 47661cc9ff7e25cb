"""Horovod's process-set names, for the one set horolite has: all ranks of `init(comm)`.

Code written for Horovod passes `process_set=hvd.global_process_set` (or leaves
the default); that works. Any other set raises NotImplementedError at once,
naming the set: a collective over a subset is never silently run over all ranks.
"""
from __future__ import annotations

from typing import Optional, Sequence

import horolite as _core

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
           "check_process_set", "check_init_process_sets"]

_WHY = ("horolite runs every collective over all ranks of init(comm); process sets other than "
        "hvd.global_process_set are not supported (run a separate job, or init(comm=[ranks]), "
        "for a subset of ranks)")


class ProcessSet:
    """Horovod's ProcessSet: a list of ranks or an mpi4py communicator. Only the global set
    (`global_process_set`) can be used with collectives here."""

    process_set_id: Optional[int] = None
    ranks: Optional[list] = None
    mpi_comm = None

    def __init__(self, ranks_or_comm):
        if isinstance(ranks_or_comm, (list, tuple, range, set)):
            ranks = sorted(ranks_or_comm)
            if any(not isinstance(r, int) for r in ranks):
                raise ValueError("ProcessSet should be initialized with a list of process ranks or "
                                 "an mpi4py Comm object")
            self.ranks = ranks
        else:
            self.mpi_comm = ranks_or_comm

    def _is_global(self) -> bool:
        return self.process_set_id == 0

    def size(self) -> Optional[int]:
        """The number of ranks in the set (None for a set horolite did not register)."""
        return _core.size() if self._is_global() else None

    def rank(self) -> Optional[int]:
        """This process's rank within the set (None for a set horolite did not register)."""
        return _core.rank() if self._is_global() else None

    def included(self) -> Optional[bool]:
        """Whether this process belongs to the set."""
        if self._is_global():
            return True
        return None if self.ranks is None else _core.rank() in self.ranks

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"

    __repr__ = __str__


class _GlobalProcessSet(ProcessSet):
    """All ranks of the job; `ranks` is filled in once init() has run."""

    def __init__(self):
        super().__init__([])
        self.process_set_id = 0

    @property
    def ranks(self):  # noqa: D401 (Horovod's attribute)
        return list(range(_core.size())) if _core.is_initialized() else []

    @ranks.setter
    def ranks(self, value):
        pass


global_process_set = _GlobalProcessSet()


def check_process_set(process_set, what: str) -> None:
    """Accept the global set (or None, horolite's own default); refuse any other, naming it."""
    if process_set is None or process_set is global_process_set or \
            (isinstance(process_set, ProcessSet) and process_set.process_set_id == 0):
        return
    raise NotImplementedError(f"{what}: process_set={process_set}: {_WHY}")


def check_init_process_sets(process_sets: Optional[Sequence]) -> None:
    """init(process_sets=...): only the global set (or none, or "dynamic" with none added)."""
    if process_sets is None or process_sets == "dynamic":
        return
    for ps in process_sets:
        check_process_set(ps, "init")


def add_process_set(process_set) -> ProcessSet:
    """Horovod's dynamic process sets: not supported (see the module docstring)."""
    raise NotImplementedError(f"add_process_set({process_set}): {_WHY}")


def remove_process_set(process_set) -> bool:
    """Horovod's dynamic process sets: not supported (see the module docstring)."""
    raise NotImplementedError(f"remove_process_set({process_set}): {_WHY}")
