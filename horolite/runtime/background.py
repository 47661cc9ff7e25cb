"""The runtime: topology at init, the background thread and its loop, shutdown.

The background thread runs one cycle after another (cycle.py: take new work, exchange
the control vector, negotiate what is not cached, run what was agreed). It is the only
thread that calls MPI after init, beside the exchange lane's (execution/lane.py). On
one host the control exchange goes through the shared-memory board
(transport/control_board.py).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import List, Optional

from ..core.mpi_library import MPI

from ..core import config as config_mod
from ..core.mpi_library import without_mpi
from ..coordination.autotune import Autotuner, parse_start
from ..coordination.control import ControlVector
from ..failure.collective_watch import CollectiveWatch
from ..errors import HorovodInternalError, ShutdownError, StallError
from ..failure.channel import FailureChannel, PeerFailure
from ..failure.heartbeat import Heartbeat
from ..failure.links import LinkLost, LinkWatch
from .cycle import Cycle
from .job_end import JobEnd
from .pacing import Pacing
from .turns import Turns
from .topology import Topology
from ..coordination.cache_hits import CacheHits
from ..execution.carried import Carrier
from ..execution.executor import Executor
from ..execution.lane import ExchangeLane, lane_wanted
from ..coordination.negotiation import Coordinator
from ..coordination.response_cache import ResponseCache
from ..coordination.stall import StallInspector
from ..coordination.straggler_round import StragglerRound
from ..coordination.tensor_queue import Entry, TensorQueue
from ..core.timeline import SetTimeline, open_timeline
from ..transport.mpi import MPITransport, oversubscribed
from ..transport.shared_memory import open_shared_memory
from ..transport.control_board import open_control_board
from ..transport.host_control import open_host_control
from ..failure.shm_files import report_to_launcher as report_shm_files
from ..transport.hierarchical import open_hierarchical
from ..transport import tcp
from ..transport.nccl import create_nccl_transport

__all__ = ["Runtime", "Topology"]

_log = logging.getLogger("horolite")


# A tensor waiting on cache bits this long falls back to full negotiation, so
# rank 0 can see it (and report it if it stalls).
CACHE_DEMOTE_SECONDS = 1.0


class Runtime(Cycle, JobEnd):
    """The job's runtime (the global process set), or a process set's: then `set_label`
    names the set in errors, `job_ranks` are its members' job ranks, and `leader` is the
    global runtime (process_sets.py)."""

    def __init__(self, comm: MPI.Comm, cfg: config_mod.Config, set_label: Optional[str] = None,
                 job_ranks: Optional[List[int]] = None, leader: Optional["Runtime"] = None,
                 timeline_prefix: str = ""):
        self.set_label = set_label
        self.leader = leader
        if leader is not None:
            # One timeline and one autotuner per process, the global set's: a set writes
            # to that timeline (SetTimeline) and runs with its tuned setting (_set_setting).
            cfg = dataclasses.replace(cfg, timeline="", autotune=False)
        self.config = cfg
        self.comm = comm
        self.topology = Topology(comm)
        self.rank = self.topology.rank
        self.size = self.topology.size
        self.job_ranks = list(job_ranks) if job_ranks is not None else list(range(self.size))
        # Blocking inside MPI spins a core; a rank whose neighbour (or whose framework's
        # threads) need that core must poll and yield instead.
        polite = cfg.wait_mode == "poll" or oversubscribed(self.topology.local_size)
        if cfg.wait_mode == "block" and polite:
            _log.warning("HOROLITE_WAIT_MODE=block ignored: %d ranks share this host's cores",
                         self.topology.local_size)
        shared = open_shared_memory(comm, polite, cfg.stall_check_time_seconds,
                                    enabled=cfg.shared_memory)
        # Failures and stalls (failure.py, collective_watch.py): every wait on other ranks
        # hears another rank's failure notice and times itself.
        hostnames = comm.allgather(self.topology.hostname)
        self.failures = FailureChannel(comm, hostnames)
        if leader is not None:  # a process set's messages name job ranks
            self.failures.where = self._where_in_job
        # Connections to peers on other hosts that closed (links.py): never sent to.
        # Ranks on one host reach each other through shared memory, not UCX's sockets.
        # (Without MPI the world's own connections raise LinkLost themselves.)
        self.links = (leader.links if leader is not None else
                      LinkWatch(comm, hostnames) if len(set(hostnames)) > 1
                      and not without_mpi() else None)
        if leader is None:
            self.failures.unsafe = self._unreachable
            if self.links is not None:
                self.failures.silent = lambda: self.links.lost is not None
        # Which peers are still heard from (heartbeat.py): what a stall report names.
        self.heartbeat = (Heartbeat(comm, hostnames, self.links) if self.size > 1 and not cfg.stall_check_disable
                          else None)
        self.watch = CollectiveWatch(self.failures, cfg.stall_check_time_seconds,
                                     cfg.stall_shutdown_time_seconds, not cfg.stall_check_disable,
                                     self.heartbeat)
        self.doomed: Optional[BaseException] = None  # set when this process must end
        self._control = ControlVector(cfg.cache_capacity)
        # The control exchange: on one host through the shared-memory board; across hosts
        # through each host's board and one rank per host (host_control.py).
        words = self._control.send.size
        board = open_control_board(comm, words, polite, shared is not None)
        self.transport = MPITransport(
            comm, polite=polite, shared_memory=shared, watch=self.watch,
            channel=self.failures, links=self.links, board=board,
            host_control=None if board is not None else open_host_control(
                comm, words, polite, cfg.shared_memory and shared is None))
        (self.transport.hierarchical_allreduce,
         self.transport.hierarchical_allgather) = open_hierarchical(
            comm, self.transport.waiter, cfg.hierarchical_allreduce, cfg.hierarchical_allgather)
        self.queue = TensorQueue()
        doorbell = (board or self.transport.host_control or self.queue).wake
        if doorbell is not None:  # peers entering a round ring it too
            self.queue.wake = doorbell
        # Across hosts the rings' pieces may travel over horolite's own TCP connections
        # (transport/tcp.py): a lost one ends the job from the next cycle, woken for it.
        use_tcp, why = tcp.choose(cfg.cross_host_transport, comm, len(set(hostnames)) > 1)
        if use_tcp:
            tcp.attach(self.transport, comm, hostnames, self.failures.where, cfg)
            self.transport.cross_host.on_lost = self.queue.wake.set
        if self.rank == 0 and len(set(hostnames)) > 1:
            _log.info("rank %d: across hosts the rings' pieces travel over %s: %s", self.rank,
                      "horolite's TCP connections" if use_tcp else "MPI", why)
        self.cache = ResponseCache(cfg.cache_capacity)
        self.timeline = (open_timeline(cfg.timeline, self.rank) if leader is None else
                         SetTimeline(leader, timeline_prefix))
        self._mark_cycles = cfg.timeline_mark_cycles
        self.executor = Executor(self.transport, self.queue, cfg.fusion_threshold, self.timeline)
        # GPU path (device.py, transport/nccl.py): collective over comm; NCCL only when every
        # rank has a GPU, else None and the reason (device arrays are then staged, core/staging.py).
        self.nccl, self.nccl_reason = create_nccl_transport(comm, self.topology.local_rank)
        if self.nccl is not None:
            from ..execution.device_executor import DeviceExecutor
            self.executor.device = DeviceExecutor(self.nccl, cfg.fusion_threshold)
        self.pacing = Pacing(self.queue, self.transport.board, self.executor.quorum)
        # Across hosts agreed allreduces run on a thread of their own (execution/lane.py).
        # `pipelined` False sends them back to this thread (the lane stays): a benchmark
        # compares both in one job. Ranks may differ in it: the calls' order is the same.
        self.lane = None
        self.pipelined = True
        if self.size > 1 and lane_wanted(cfg.exchange_pipeline, self.topology.hosts,
                                         MPI.Query_thread() == MPI.THREAD_MULTIPLE):
            self.lane = ExchangeLane(self.executor, self.queue.wake,
                                     f"horolite-exchange-{self.rank}"
                                     + (f"-{set_label}" if set_label else ""))
            control_watch = CollectiveWatch(self.failures, cfg.stall_check_time_seconds,
                                            cfg.stall_shutdown_time_seconds,
                                            not cfg.stall_check_disable, self.heartbeat)
            control_watch.also = self.lane.check
            self.transport.split_control(control_watch)  # (both threads poll)
            self.pacing.waiting = self._waiting
            if cfg.wait_mode == "block" and not polite and leader is None:
                _log.warning("rank %d: HOROLITE_WAIT_MODE=block ignored: the exchange lane "
                             "(HOROLITE_EXCHANGE_PIPELINE) waits on MPI on a thread of its own, "
                             "so both threads poll (a blocked wait would hold the one receive "
                             "failure notices arrive on); HOROLITE_EXCHANGE_PIPELINE=0 keeps "
                             "blocking", self.rank)
            polite = True  # (as the log line below says)
        # Small cached allreduces ride in the board's control round (execution/carried.py).
        self.carrier = (Carrier(self.transport.board, self.executor)
                        if self.transport.board is not None and self.cache.capacity else None)
        self.hits = CacheHits(self.cache, self.carrier,
                              min(CACHE_DEMOTE_SECONDS, cfg.stall_check_time_seconds / 2))
        # A caller that waits runs the cycles itself (turns.py), on one host.
        self.turns = Turns(self._cycle, lambda: self.timeline.flush(), self._wanted,
                           self.queue.wake, self.rank)
        self._helper = self.turns.caller if self.transport.board is not None else None
        self.coordinator = (Coordinator(self.size, self.job_ranks if leader is not None else None)
                            if self.rank == 0 else None)
        self.stall = (StallInspector(cfg.stall_check_time_seconds, cfg.stall_shutdown_time_seconds,
                                     self.failures.where if leader is None else
                                     lambda job_rank: self._where_in_job(self.job_ranks.index(job_rank)))
                      if self.rank == 0 and not cfg.stall_check_disable else None)
        # Who comes last, and how long the others wait (straggler_round.py).
        self.stragglers = StragglerRound(self.rank, self.job_ranks, hostnames,
                                         cfg.straggler_report_seconds,
                                         f"{set_label}: " if set_label else "")
        self._unsent: List[Entry] = []
        self._invalid: set = set()
        self._joined = False
        self._shutdown_requested = threading.Event()
        self._late_lock = threading.Lock()  # quorum answers after shutdown: callers' threads
        self._exiting: Optional[int] = None
        self._hard_exit: Optional[threading.Event] = None  # set: the hard exit is cancelled
        self._fatal: Optional[BaseException] = None
        self._cycle_seconds = cfg.cycle_time_ms / 1000.0
        self.autotuner = (Autotuner(cfg, start=parse_start(cfg.autotune_start))
                          if cfg.autotune and self.rank == 0 else None)
        self._setting = ((self.autotuner.setting if self.autotuner else
                          (cfg.fusion_threshold, cfg.cycle_time_ms)))
        _log.info("horolite runtime up: rank %d of %d on %s (local %d/%d)%s", self.rank,
                  self.size, self.topology.hostname, self.topology.local_rank,
                  self.topology.local_size, ", polling MPI" if polite else ", blocking in MPI")
        if leader is None:
            report_shm_files(self.rank)
            # Process sets are made over a communicator of their own (the background
            # thread owns `comm`): see process_sets.py.
            self.set_comm = comm.Dup()
        _log.info("rank %d: allreduce %s", self.rank,
                  "through shared memory (every rank on this host)" if shared is not None
                  else "over the ring of TCP messages" if self.transport.cross_host is not None
                  else "over the ring of MPI messages")
        self._thread = threading.Thread(target=self._loop, name=f"horolite-background-{self.rank}"
                                        + (f"-{set_label}" if set_label else ""),
                                        daemon=True)
        self._thread.start()

    def _where_in_job(self, set_rank: int) -> str:
        """'rank 3 (host node2)' for a process set's rank 1 whose job rank is 3."""
        hosts = self.failures.hostnames
        host = hosts[set_rank] if 0 <= set_rank < len(hosts) else "?"
        job = self.job_ranks[set_rank] if 0 <= set_rank < len(self.job_ranks) else set_rank
        return f"rank {job} (host {host})"

    # ---- caller side ----
    def submit(self, entry: Entry, ring: bool = True):
        """Queue `entry`. ring=False: its caller waits for it at once and runs the cycle
        itself (turns.py), so the background thread is left asleep. (Asynchronous work
        wakes the background thread, which takes it while the caller goes on: a caller
        that then waits leaves the cycles to it, rather than race it for rounds.)"""
        if ring or self._helper is None:
            return self.queue.submit(entry)
        entry.handle.helper = self._helper
        return self.queue.submit(entry, False)

    def _waiting(self) -> bool:
        """With an exchange lane: whether work beyond the lane's is in flight."""
        return self.queue.has_inflight() and self.lane.leaves_waiting(self.queue)

    def _wanted(self, peers: bool = True) -> bool:
        """Whether a cycle is needed now: work here, shutdown, or (`peers`) a peer
        waiting in a round this rank has not entered."""
        board = self.transport.board
        return (self.queue.has_new() or self.queue.has_inflight()
                or self._shutdown_requested.is_set()
                or (peers and board is not None and board.awaited()))

    def shutdown(self, timeout: float = 30.0, exiting: Optional[int] = None) -> None:
        """Ask every rank to stop; fail what is pending; never hang. `exiting`: this
        process is exiting (the exit code, or -1 when unknown): other ranks' pending
        collectives then fail naming this rank as the one that left."""
        self._exiting = exiting
        if self._hard_exit is not None and exiting is None:
            self._hard_exit.set()  # the user's code handled the failure and shuts down itself
        self._shutdown_requested.set()
        self.queue.wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if self._hard_exit is not None and exiting is None:
                self._hard_exit.set()  # (armed by a failure the thread found as it stopped)
            if self._thread.is_alive():
                _log.warning("rank %d: background thread did not stop within %.0f s "
                             "(another rank may have died); giving up on it", self.rank, timeout)
                self._fail_pending(ShutdownError("horolite was shut down before this collective completed"))
        if self.nccl is not None and not self._thread.is_alive():
            self.nccl.close()  # GPU path: free the communicator so a later init() makes a new one
        self.timeline.close()
        if self.doomed is not None and exiting is None and not self._thread.is_alive():
            self.failures.say_ended()  # its user code handled the failure: nobody waits for it

    def _set_setting(self):
        """A process set runs with the global set's current (fusion threshold, cycle
        time in ms): as in Horovod, the tuned parameters are the process's, not a set's."""
        leader = self.leader
        return leader.executor.fusion_threshold, leader._cycle_seconds * 1000.0

    def set_timeline(self, timeline, mark_cycles: bool) -> None:
        """Swap the timeline (start_timeline/stop_timeline). The background thread may
        still write a span to the old one: closed, it drops it."""
        old, self.timeline = self.timeline, timeline
        self.executor.timeline = timeline
        self._mark_cycles = mark_cycles
        old.close()

    # ---- background thread ----
    def _loop(self) -> None:
        try:
            while True:
                start = time.monotonic()
                alive = self.turns.background()  # flushes the timeline: one write per cycle
                if not alive:
                    # Every rank stops at the same agreed cycle, so collective cleanup is safe.
                    if self.lane is not None:
                        self.lane.drain()  # (closed below, as on every way out)
                    self.transport.close()
                    if self.doomed is None:
                        if self.heartbeat is not None:
                            self.heartbeat.close(self._unreachable())
                        self.failures.close()
                    break
                self.pacing.rest(start, self._cycle_seconds)
        except PeerFailure as e:  # heard inside a wait: another rank failed (or this one)
            self._end_for_failure(e.notice)
        except LinkLost as e:  # a peer's connection closed: no more sends to it
            self._end_for_lost_link(e)
        except MPI.Exception as e:  # the MPI library's error: a peer that died, most often
            self._end_for_mpi_error(e)
        except StallError as e:  # a collective stalled inside a wait, on this rank
            self._end_for_failure(None, e)
        except BaseException as e:  # a bug: report it everywhere rather than hang the job
            _log.exception("rank %d: background thread failed", self.rank)
            self._end_for_failure(None, HorovodInternalError(
                f"{self.failures.where(self.rank)}: horolite's background thread failed: {e!r}"))
        if self.lane is not None:
            self.lane.close()
        if self.doomed is not None and self.transport.cross_host is not None:
            self.transport.cross_host.abort()  # (peers waiting on this rank fail at once)
