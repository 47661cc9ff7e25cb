"""Process sets (Horovod's): collectives over a subset of the job's ranks.

Every set other than the global one gets a Runtime of its own (runtime.py) on a
sub-communicator of the job's: its own queue, background thread, negotiation,
response cache, shared-memory window and failure channel. Sets therefore
negotiate and cache independently, and collectives of different sets run
concurrently in any order. Ranks are the job's (global) ranks throughout, as in
Horovod: `ProcessSet([0, 2])`, a broadcast's `root_rank`; `ps.rank()` is this
process's rank within the set (the order of its results).

Sets are made collectively over all ranks of the job (init(process_sets=...),
add_process_set), in the same order on every rank; a rank outside a set keeps
only its id and ranks.
"""
from __future__ import annotations

import logging
from typing import Dict, List, Optional, Sequence

from ..core.handle import Handle
from ..errors import InvalidCollectiveError, prefixed
from ..runtime import registry

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
           "get_process_set_ids_and_ranks", "runtime_for", "SetHandle"]

_log = logging.getLogger("horolite.api.process_sets")


class ProcessSet:
    """A set of the job's ranks that run collectives together: built from a list of
    (global) ranks or an mpi4py communicator, then passed to init(process_sets=[...]) or
    add_process_set(); `process_set_id` is set once it is registered."""

    process_set_id: Optional[int] = None
    ranks: Optional[List[int]] = None
    mpi_comm = None

    def __init__(self, ranks_or_comm):
        if isinstance(ranks_or_comm, (list, tuple, range, set, frozenset)):
            ranks = sorted(ranks_or_comm)
            if any(not isinstance(r, int) for r in ranks):
                raise ValueError("ProcessSet should be initialized with a list of process ranks or "
                                 "an mpi4py Comm object")
            self.ranks = ranks
        else:
            from ..core.mpi_library import MPI
            if not isinstance(ranks_or_comm, MPI.Comm):
                raise ValueError("ProcessSet should be initialized with a list of process ranks or "
                                 "an mpi4py Comm object")
            self.mpi_comm = ranks_or_comm

    def _invalidate(self) -> None:
        self.process_set_id = None

    def size(self) -> Optional[int]:
        """The number of ranks in the set, or None if it has no id yet."""
        if self.process_set_id is None:
            return None
        return len(_entry_of(self.process_set_id).ranks)

    def rank(self) -> Optional[int]:
        """This process's rank within the set (None if it has no id yet; a ValueError
        outside the set, as in Horovod). Collectives still take job ranks (root_rank)."""
        if self.process_set_id is None:
            return None
        entry = _entry_of(self.process_set_id)
        me = registry.global_runtime().topology.rank
        if me not in entry.ranks:
            raise ValueError("Process is not part of provided process set.")
        return entry.ranks.index(me)

    def included(self) -> Optional[bool]:
        """Whether this process belongs to the set (None before its ranks are known)."""
        if self.ranks is None:
            return None
        return registry.global_runtime().topology.rank in self.ranks

    def __str__(self) -> str:
        return (f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, "
                f"mpi_comm={self.mpi_comm})")

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


_lock = registry.lock
_table = registry.table
_Entry = registry.Entry
_dynamic = False


def _entry_of(process_set_id: int) -> _Entry:
    registry.global_runtime()  # NotInitializedError before init
    entry = _table.get(process_set_id)
    if entry is None:
        raise ValueError("Process set does not exist or has not been registered.")
    return entry


def label(process_set_id: int, ranks: Sequence[int]) -> str:
    """How errors name a set: its id and job ranks."""
    return f"process set {process_set_id} (job ranks {list(ranks)})"


class SetHandle(Handle):
    """A handle of a collective on a process set: its errors name the set."""
    __slots__ = ("set_label",)

    def __init__(self, name, transform=None, set_label: str = ""):
        super().__init__(name, transform)
        self.set_label = set_label

    def labelled(self, exc: BaseException) -> BaseException:
        if self.set_label and self.set_label not in str(exc):
            return prefixed(exc, self.set_label)
        return exc

    def _set_exception(self, exc: BaseException) -> None:
        super()._set_exception(self.labelled(exc))


# ---- the table, kept by basics.init/shutdown ----
def setup(global_runtime, process_sets, dynamic: bool) -> None:
    """At init (collective over the job): register the global set, then each of
    `process_sets` in order. A duplicate entry is a ValueError, as in Horovod."""
    global _dynamic
    with _lock:
        _table.clear()
        _table[0] = _Entry(list(range(global_runtime.size)), global_runtime)
        global_process_set.ranks = list(range(global_runtime.size))
        _dynamic = dynamic
        for index, ps in enumerate(process_sets):
            if not isinstance(ps, ProcessSet):
                raise ValueError(f"init(process_sets=...): entry {index} is {ps!r}, not a ProcessSet")
            if ps.ranks is None:
                ps.ranks = _ranks_of_comm(global_runtime, ps.mpi_comm)
            _agree(global_runtime, ps.ranks)
            found = _find(ps.ranks)
            if found is not None:
                ps._invalidate()
                raise ValueError(f"Horovod could not be initialized because process_sets entry "
                                 f"number {index} is a duplicate: {ps}")
            ps.process_set_id = _create(global_runtime, ps.ranks)


def bind_again(process_sets) -> None:
    """init(process_sets=...) while initialized: each set must already be registered
    (it then gets its id); a new set, or "dynamic" on a job started without it, is a
    ValueError, never silently ignored. No communication: ranks may call this alone."""
    with _lock:
        if isinstance(process_sets, str):
            if process_sets.lower() == "dynamic" and not _dynamic:
                raise ValueError('init(process_sets="dynamic") on a runtime already initialized '
                                 'without dynamic process sets: call shutdown() first')
            return
        for ps in process_sets:
            found = _find(ps.ranks) if isinstance(ps, ProcessSet) and ps.ranks is not None else None
            if found is None:
                registered = {pid: e.ranks for pid, e in sorted(_table.items())}
                raise ValueError(
                    f"init(process_sets=...): horolite is already initialized and {ps} is not one "
                    f"of its process sets {registered}; call shutdown() first, or add it with "
                    f"add_process_set() (dynamic process sets)")
            ps.process_set_id = found


def _ranks_of_comm(global_runtime, comm) -> List[int]:
    """The job ranks of a communicator's members (every rank calls this, members or not)."""
    from ..core.mpi_library import MPI
    mine = comm.Get_rank() if comm != MPI.COMM_NULL else -1
    ranks = global_runtime.set_comm.allgather(mine)
    members = [(r, q) for q, r in enumerate(ranks) if r >= 0]
    return [q for r, q in sorted(members)]


def _find(ranks: Sequence[int]) -> Optional[int]:
    for pid, entry in _table.items():
        if entry.ranks == list(ranks):
            return pid
    return None


def _agree(global_runtime, ranks: List[int]) -> None:
    """Every rank names the same ranks (else a ValueError on every rank, not a hang)."""
    everyone = global_runtime.set_comm.allgather(list(ranks))
    if any(other != everyone[0] for other in everyone):
        differing = {q: other for q, other in enumerate(everyone)}
        raise ValueError(f"process sets are made by every rank in the same order, with the same "
                         f"ranks; this one differs by rank: {differing}")


def _create(global_runtime, ranks: List[int]) -> int:
    """Make the set's communicator and (on members) its Runtime; collective over the job."""
    from ..core.mpi_library import MPI
    size = global_runtime.size
    if not ranks or len(set(ranks)) != len(ranks) or any(not 0 <= r < size for r in ranks):
        raise ValueError(f"process set ranks {ranks}: must be distinct ranks within 0..{size - 1}")
    if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        raise ValueError("process sets need MPI's THREAD_MULTIPLE (each set has a background "
                         "thread of its own): unset HOROLITE_MPI_THREADS_DISABLE")
    pid = next(i for i in range(1, len(_table) + 2) if i not in _table)
    me = global_runtime.rank
    comm = global_runtime.set_comm.Split(0 if me in ranks else MPI.UNDEFINED, ranks.index(me)
                                         if me in ranks else 0)
    runtime = None
    if comm != MPI.COMM_NULL:
        from ..runtime.background import Runtime
        runtime = Runtime(comm, global_runtime.config, set_label=label(pid, ranks),
                          job_ranks=ranks, leader=global_runtime,
                          timeline_prefix=f"process set {pid}/")
    _table[pid] = _Entry(list(ranks), runtime)
    if runtime is not None:  # its shared-memory window is a new /dev/shm file
        from ..failure.shm_files import report_to_launcher
        report_to_launcher(me)
    _log.debug("rank %d: %s registered%s", me, label(pid, ranks), "" if runtime else " (not a member)")
    return pid


def clear() -> list:
    """Forget every set (shutdown); returns their runtimes on this rank, global last."""
    with _lock:
        global_process_set.ranks = []
        return registry.clear()


# ---- the public calls ----
def _global_runtime():
    return registry.global_runtime()


def add_process_set(process_set) -> ProcessSet:
    """Register a set after init (needs init(process_sets="dynamic") or
    HOROLITE_DYNAMIC_PROCESS_SETS=1); every rank of the job calls it, in the same order.
    Returns the set, registered. A set with the same ranks as a registered one is a
    ValueError."""
    rt = _global_runtime()
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.ranks is None and process_set.mpi_comm is not None:
        raise NotImplementedError("Dynamically adding process sets defined by an MPI communicator "
                                  "is not implemented. Please build the process set via a list of ranks.")
    with _lock:
        if not _dynamic:
            raise ValueError("Set HOROVOD_DYNAMIC_PROCESS_SETS=1 (or call init(process_sets="
                             "\"dynamic\")) to allow adding process sets after Horovod initialization.")
        _agree(rt, process_set.ranks)
        if _find(process_set.ranks) is not None:
            raise ValueError(f"Attempted to add a duplicate process set: {process_set}")
        process_set.process_set_id = _create(rt, process_set.ranks)
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a set (every rank of the job calls it): its members stop its runtime,
    failing what is still pending on it. False for the global set or one without an id
    (at once, as in Horovod) or one not registered. As in Horovod, the set object loses its
    id before anything is asked, even when the call then raises."""
    pid = process_set.process_set_id
    if pid is None or pid == 0:
        return False
    process_set._invalidate()
    _global_runtime()
    with _lock:
        if not _dynamic:
            raise ValueError("Set HOROVOD_DYNAMIC_PROCESS_SETS=1 (or call init(process_sets="
                             "\"dynamic\")) to allow removing process sets after Horovod initialization.")
        entry = _table.pop(pid, None)
    if entry is None:
        return False
    if entry.runtime is not None:
        entry.runtime.shutdown()
    return True


def get_process_set_ids_and_ranks() -> Dict[int, List[int]]:
    """{process_set_id: its job ranks} of every registered set, the global one included."""
    _global_runtime()
    with _lock:
        return {pid: list(e.ranks) for pid, e in sorted(_table.items())}


def runtime_for(process_set, what: str):
    """The runtime that runs a collective on `process_set` (None: the global set), or a
    clear error: not a ProcessSet, not registered, or this rank is not in it."""
    if process_set is None or process_set is global_process_set:
        return _global_runtime()
    if not isinstance(process_set, ProcessSet):
        raise InvalidCollectiveError(f"{what}: process_set={process_set!r} is not a ProcessSet")
    pid = process_set.process_set_id
    if pid == 0:
        return _global_runtime()
    rt = _global_runtime()
    entry = _table.get(pid) if pid is not None else None
    if entry is None:
        raise InvalidCollectiveError(
            f"{what}: {process_set} is not registered (pass it to init(process_sets=[...]) or "
            "add_process_set() first, on every rank)")
    if entry.runtime is None:
        raise InvalidCollectiveError(
            f"{what}: rank {rt.rank} is not a member of {label(pid, entry.ranks)}")
    return entry.runtime


def is_doomed() -> bool:
    """Whether any runtime on this rank must end (atexit)."""
    return any(getattr(rt, "doomed", None) is not None for rt in registry.runtimes())

