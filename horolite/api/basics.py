"""Process-level state: init, shutdown and the topology queries."""
from __future__ import annotations

import atexit
import logging
import os
import threading

from ..core import config as config_mod
from ..core import log, settings
from ..core.mpi_library import without_mpi
from ..failure import launch_check, process_hooks
from ..failure.shm_files import remove_mapped
from ..runtime import registry
from ..world import identity_used, open_world
from ..world.identity import log_once
from . import process_sets as _process_sets

__all__ = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
           "cross_rank", "cross_size", "is_homogeneous", "mpi_threads_supported", "runtime",
           "start_timeline", "stop_timeline"]

_log = logging.getLogger("horolite.api.basics")
_lock = threading.Lock()
_atexit_registered = False


def init(comm=None, process_sets=None) -> None:
    """Start horolite on `comm` (an mpi4py communicator or a list of world ranks; default: all).

    process_sets (Horovod's): a list of ProcessSet to register besides the global set, or
    "dynamic" to allow add_process_set()/remove_process_set() later (process_sets.py).
    Calling it again while initialized does nothing, but for process_sets: those must
    already be registered (they get their ids), else a ValueError.
    """
    global _atexit_registered
    with _lock:
        if registry.current() is not None:
            if process_sets is not None:
                _process_sets.bind_again(process_sets)
            return
        cfg = config_mod.from_environ()
        _set_thread_level(cfg)
        MPI = open_world()
        from ..runtime.background import Runtime

        if not without_mpi():
            launch_check.check(MPI.COMM_WORLD.Get_size(), os.environ, MPI.Get_library_version)
        comm = _communicator(MPI, comm)
        log.configure(cfg.log_level, comm.Get_rank(), comm.Get_size(), cfg.log_hide_time)
        if identity_used() is not None:  # (a job without MPI: where its ranks came from)
            log_once(identity_used(), _log)
        if comm.Get_rank() == 0:
            for variable, advice in settings.unhonoured():
                _log.warning("%s is set but %s", variable, advice)
        dynamic = cfg.dynamic_process_sets
        if isinstance(process_sets, str):
            if process_sets.lower() != "dynamic":
                raise ValueError(f"init(process_sets={process_sets!r}): a list of ProcessSet, "
                                 "None or \"dynamic\"")
            process_sets, dynamic = [], True
            os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"  # as Horovod does
        process_sets = list(process_sets or [])
        rt = Runtime(comm, cfg)
        try:
            _process_sets.setup(rt, process_sets, dynamic)
        except BaseException:  # (every rank fails alike: the sets are agreed first)
            runtimes = _process_sets.clear()
            _stop(runtimes + ([rt] if rt not in runtimes else []))
            raise
        registry.set_global(rt)
        if not _atexit_registered:
            atexit.register(_shutdown_at_exit)
            _atexit_registered = True
        process_hooks.install(_current_runtime, _after_fork_in_child)


def _set_thread_level(cfg) -> None:
    """HOROLITE_MPI_THREADS_DISABLE: ask MPI for SERIALIZED, enough for the one background
    thread that calls MPI. Only MPI's first initialization can choose."""
    import sys
    if not cfg.mpi_threads_disable:
        return  # mpi4py's own default (or the user's mpi4py.rc): MULTIPLE
    try:
        import mpi4py
    except ImportError:
        return  # load_mpi says what to install
    if "mpi4py.MPI" not in sys.modules:
        mpi4py.rc.thread_level = "serialized"
    elif mpi4py.rc.thread_level != "serialized":
        _log.warning("HOROLITE_MPI_THREADS_DISABLE=1 has no effect: MPI was imported before "
                     "horolite.init() (set it before the first `from mpi4py import MPI`)")


def _communicator(MPI, comm):
    if comm is None:
        return MPI.COMM_WORLD
    if isinstance(comm, MPI.Comm):
        return comm
    ranks = [int(r) for r in comm]
    world = MPI.COMM_WORLD
    if len(set(ranks)) != len(ranks) or any(not 0 <= r < world.Get_size() for r in ranks):
        raise ValueError(f"init(comm={ranks}): ranks must be distinct and within 0..{world.Get_size() - 1}")
    if world.Get_rank() not in ranks:
        raise ValueError(f"init(comm={ranks}): world rank {world.Get_rank()} is not in the list, "
                         "so it cannot join this horolite job")
    group = world.Get_group().Incl(ranks)
    return world.Create_group(group)


def shutdown() -> None:
    """Stop the background thread; pending collectives fail with ShutdownError on every rank."""
    with _lock:
        rt = registry.current()
        registry.set_global(None)
        runtimes = _process_sets.clear() if rt is not None else []
    _stop(runtimes)


def _stop(runtimes, **how) -> None:
    """Stop every process set's runtime (the global one last): all are asked first, so
    ranks that stop their sets in another order do not wait on each other."""
    for rt in runtimes:
        if not isinstance(rt, process_hooks.ForkedRuntime):
            rt._exiting = how.get("exiting")
            rt._shutdown_requested.set()
            rt.queue.wake.set()
    for rt in runtimes:
        rt.shutdown(**how)


def _current_runtime():
    return registry.current()


def _shutdown_at_exit() -> None:
    """At interpreter exit: other ranks' pending collectives name this rank as the one that
    left. A process whose job cannot go on (a failure, a stall shutdown) ends here, before
    MPI_Finalize, which would wait for ranks that may never get there."""
    with _lock:
        rt = registry.current()
        registry.set_global(None)
    if rt is None or not process_hooks.in_init_process():
        return
    runtimes = _process_sets.clear()
    doomed = any(r.doomed is not None for r in runtimes) or rt.doomed is not None
    code = process_hooks.exit_code()
    _stop(runtimes or [rt], timeout=1.0 if doomed else 30.0,
          exiting=-1 if code is None else code)
    if doomed:
        try:
            remove_mapped()  # no MPI_Finalize to unlink the job's shared memory
            _end_together(rt)
        except Exception as e:  # (an MPI error to a peer that just ended, say)
            _log.warning("the failed job's end: %s: %s", type(e).__name__, e)
        finally:  # never on to MPI_Finalize, which would wait for ranks that are gone
            process_hooks.exit_now(1 if code is None else code)


def _end_together(rt) -> None:
    """A failed job's ranks end together: mpirun ends them all once one ends with an
    error, which would cut short the others' handling of it (failure/channel.py); the rank
    the failure came from ends first, as mpirun then names the first to end."""
    from ..runtime.job_end import EXIT_GRACE_SECONDS  # (imports MPI: not before init)
    if rt._thread.is_alive():  # (else MPI could be called from two threads at once)
        return
    rt.failures.say_ended()
    if rt.failures.await_ended(EXIT_GRACE_SECONDS):
        rt.failures.let_the_origin_end_first()


def is_initialized() -> bool:
    return registry.current() is not None


def runtime():
    return registry.global_runtime()


def _after_fork_in_child() -> None:
    """A child forked after init() must never touch MPI (its connection is the parent's):
    the topology queries still answer, collectives raise at once, nothing is finalized."""
    registry.replace_runtimes(process_hooks.ForkedRuntime)


def rank() -> int:
    return runtime().topology.rank


def size() -> int:
    return runtime().topology.size


def local_rank() -> int:
    return runtime().topology.local_rank


def local_size() -> int:
    return runtime().topology.local_size


def cross_rank() -> int:
    return runtime().topology.cross_rank


def cross_size() -> int:
    return runtime().topology.cross_size


def is_homogeneous() -> bool:
    return runtime().topology.is_homogeneous


def mpi_threads_supported() -> bool:
    runtime()
    from ..core.mpi_library import MPI
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record a timeline to file_path from now on (rank r > 0 writes file_path with
    `.rank<r>` before the extension), as HOROLITE_TIMELINE does from init(). A
    timeline already recording is closed first."""
    if not file_path:
        raise ValueError("start_timeline: file_path is empty")
    from ..core.timeline import Timeline
    rt = runtime()
    rt.set_timeline(Timeline(str(file_path), rt.rank), bool(mark_cycles))


def stop_timeline() -> None:
    """Stop recording and close the timeline file (the file stays valid JSON)."""
    from ..core.timeline import NullTimeline
    runtime().set_timeline(NullTimeline(), False)
