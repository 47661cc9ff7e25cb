"""The MPI transport: point-to-point links for the ring, plus the control plane.

Only the background thread calls these, or, where there is an exchange lane
(execution/lane.py), the lane's thread the data plane and the background thread
the control plane, each with its own waiter. When ranks outnumber cores, a rank
that blocks inside MPI spins and steals the core its neighbour needs, so in
that case waits poll and yield instead of blocking.
"""
from __future__ import annotations

import os
import time
from typing import Callable, List, Optional, Sequence

import numpy as np
from ..core.mpi_library import MPI

from .ring import Ring

__all__ = ["PointToPoint", "MPITransport", "oversubscribed"]

_DATA_TAG = 7
CONTROL_LABEL = "this cycle's control message"


def oversubscribed(local_size: int) -> bool:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return local_size > cores


class Waiter:
    """Waits on MPI requests, blocking in C or polling with yields.

    `watch(waited_seconds, peer)`, when given, is called every WATCH_EVERY seconds of
    one wait (polling), or when another rank's failure notice arrives (blocking: the
    wait also waits on `channel.request`, the failure channel's posted receive). It
    raises to abandon the wait: that is how a rank blocked inside a collective hears
    that another rank failed or that the collective stalled (collective_watch.py).
    """

    WATCH_EVERY = 0.02
    IDLE_PAUSE = 0.002  # the longest sleep of an idle rank's poll
    sleep = staticmethod(time.sleep)  # an instance's own, so a test can watch its sleeps

    def __init__(self, polite: bool, watch: Optional[Callable] = None, channel=None,
                 links=None):
        self.polite = polite
        self.watch = watch
        self.channel = channel
        # failure/links.py's LinkWatch, or None: MPICH's UCX layer crashes a rank that sends
        # to a peer on another host once that peer's connection closed, and a nonblocking
        # collective sends from inside MPI's progress, so while there are such connections
        # every send and every look at a request (progress) comes after links.check(), and
        # waits poll instead of blocking inside MPI.
        self.links = links

    def guard(self) -> None:
        if self.links is not None:
            self.links.check()

    def _blocking(self) -> bool:
        return not self.polite and (self.links is None or not self.links.remote)

    def wait(self, req: MPI.Request, peer: int = -1, idle=None) -> None:
        """idle: a wake-up (coordination/tensor_queue.Wake) set when this rank gets work;
        while it is unset, nothing of this rank's rides on the wait, so it polls slowly."""
        if self._blocking():
            self._block([req])
            return
        self._poll(req.Test, peer, idle)

    def wait_all(self, reqs: Sequence[MPI.Request], peer: int = -1) -> None:
        if not reqs:
            return
        if self._blocking():
            self._block(list(reqs))
            return
        self._poll(lambda: MPI.Request.Testall(reqs), peer)

    def wait_any(self, reqs: Sequence[MPI.Request], peer: int = -1) -> int:
        """Wait until one of `reqs` (all active) completes; returns its index."""
        if not self._blocking():
            found = []

            def test():
                index, flag = MPI.Request.Testany(reqs)
                if flag:
                    found.append(index)
                return flag
            self._poll(test, peer)
            return found[0]
        channel = self.channel
        if channel is None or channel.request is None or self.watch is None:
            return MPI.Request.Waitany(reqs)
        while True:
            index = MPI.Request.Waitany(list(reqs) + [channel.request], channel.status)
            if index < len(reqs):
                return index
            channel.completed()
            self.watch(0.0, -1)  # raises: another rank's notice arrived

    def _block(self, reqs) -> None:
        channel = self.channel
        if channel is None or channel.request is None or self.watch is None:
            MPI.Request.Waitall(reqs)
            return
        pending = list(reqs)
        while pending:  # blocks in C until one completes: a request, or a failure notice
            index = MPI.Request.Waitany(pending + [channel.request], channel.status)
            if index == len(pending):
                channel.completed()
                self.watch(0.0, -1)  # raises: another rank's notice arrived
            pending = [r for r in pending if r != MPI.REQUEST_NULL]

    def _poll(self, test, peer: int, idle=None) -> None:
        # Spin briefly (a neighbour that is running answers in microseconds), then
        # yield, then sleep longer and longer so a descheduled neighbour gets the core,
        # but at most 100 us: the partner that arrives last would otherwise wait for
        # this rank's sleep to end (500 us here made ranks leave ~0.5 ms apart).
        # An idle rank's exchange can wait for a peer's next cycle for a whole training
        # step: looking every 100 us then takes thousands of wake-ups from the core the
        # framework computes on, so it looks every IDLE_PAUSE, and at once if work arrives.
        spins = 0
        pause = 1e-5
        start = next_watch = 0.0
        guard = self.guard if self.links is not None else None
        while True:
            if guard is not None:
                guard()
            if test():
                return
            spins += 1
            if spins > 64:
                if spins < 80:
                    self.sleep(0)
                elif idle is not None and not idle.is_set():
                    idle.wait(pause)
                    pause = min(pause * 1.5, self.IDLE_PAUSE)
                else:
                    self.sleep(min(pause, 1e-4))
                    pause = min(pause * 1.5, 1e-4)
                    if self.watch is not None:
                        now = time.monotonic()
                        if not start:
                            start, next_watch = now, now + self.WATCH_EVERY
                        elif now >= next_watch:
                            next_watch = now + self.WATCH_EVERY
                            self.watch(now - start, peer)


class PointToPoint:
    """Messages to the right neighbour and from the left one, on a private communicator."""

    def __init__(self, comm: MPI.Comm, waiter: Waiter):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.right = (self.rank + 1) % self.size
        self.left = (self.rank - 1) % self.size
        self._waiter = waiter

    def isend(self, buf: np.ndarray, dest: int = -1, tag: int = -1) -> MPI.Request:
        self._waiter.guard()
        return self.comm.Isend(buf, self.right if dest < 0 else dest, _DATA_TAG if tag < 0 else tag)

    def irecv(self, buf: np.ndarray, source: int = -1, tag: int = -1) -> MPI.Request:
        return self.comm.Irecv(buf, self.left if source < 0 else source,
                               _DATA_TAG if tag < 0 else tag)

    def sendrecv(self, send: np.ndarray, recv: np.ndarray, dest: int = -1, source: int = -1) -> None:
        reqs = [self.irecv(recv, source), self.isend(send, dest)]
        self._waiter.wait_all(reqs, self.left if source < 0 else source)

    def wait(self, req) -> None:
        self._waiter.wait(req, self.left)

    def wait_all(self, reqs) -> None:
        self._waiter.wait_all(reqs, self.right)


def gather_bytes(comm: MPI.Comm, waiter, data: bytes, root: int = 0):
    """Every rank's `data` at `root` over `comm` (a list in rank order; None elsewhere)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    waiter.guard()
    lengths = np.empty(size, dtype=np.int64) if rank == root else None
    wait = waiter.wait
    wait(comm.Igather(np.array([len(data)], dtype=np.int64), lengths, root=root))
    if rank != root:
        wait(comm.Igatherv(np.frombuffer(data, dtype=np.uint8), None, root=root))
        return None
    offsets = np.zeros(size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    out = np.empty(int(offsets[-1]), dtype=np.uint8)
    wait(comm.Igatherv(np.frombuffer(data, dtype=np.uint8),
                       [out, lengths, offsets[:-1], MPI.BYTE], root=root))
    raw = out.tobytes()
    return [raw[offsets[q]:offsets[q + 1]] for q in range(size)]


def bcast_bytes(comm: MPI.Comm, waiter, data, root: int = 0) -> bytes:
    """`data` from `root` (ignored elsewhere) on every rank of `comm`."""
    rank = comm.Get_rank()
    waiter.guard()
    length = np.array([len(data) if rank == root else 0], dtype=np.int64)
    waiter.wait(comm.Ibcast(length, root=root))
    buf = (np.frombuffer(data, dtype=np.uint8).copy() if rank == root
           else np.empty(int(length[0]), dtype=np.uint8))
    waiter.wait(comm.Ibcast(buf, root=root))
    return data if rank == root else buf.tobytes()


class MPITransport:
    """Host-memory collectives: the ring for reductions and gathers, MPI for the rest."""

    device = "cpu"

    def __init__(self, comm: MPI.Comm, polite: bool, shared_memory=None, watch=None,
                 channel=None, links=None, board=None, host_control=None):
        """shared_memory: a shared_memory.SharedMemoryAllreduce for allreduce when every
        rank is on this host, else None (the ring over MPI). board: a
        control_board.ControlBoard that then carries the control exchange and
        negotiation, else None: then host_control, a host_control.HostControl where ranks
        share hosts across several hosts, or None (MPI's collectives over every rank).
        watch, channel, links: see Waiter."""
        self.waiter = Waiter(polite, watch, channel, links)
        # The control plane's waits: the same waiter, unless the data plane runs on a
        # thread of its own (split_control).
        self.control_waiter = self.waiter
        self.shared_memory = shared_memory
        self.board = board
        self.host_control = host_control
        if host_control is not None:
            host_control.waiter = self.waiter
        self.data_comm = comm.Dup()
        self.control_comm = comm.Dup()
        self.link = PointToPoint(self.data_comm, self.waiter)
        self.ring = Ring(self.link)
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        # transport.hierarchical.Hierarchical objects, set by the runtime where ranks share
        # hosts across several hosts; None: the flat ring.
        self.hierarchical_allreduce = None
        self.hierarchical_allgather = None
        # transport.tcp.TcpMesh when the rings' pieces cross hosts over horolite's own TCP
        # connections (the rings' links are then tcp_link.TcpLink), else None.
        self.cross_host = None
        # transport.tcp_control.TcpControl when the control exchange among every rank goes
        # over those connections too (hosts of one rank each), else None.
        self.control_tcp = None
        # Which path served each allreduce and allgather (one add each): how tests see
        # that a setting or a host layout took effect.
        self.paths = {"shared_memory": 0, "hierarchical": 0, "ring": 0,
                      "hierarchical_allgather": 0, "ring_allgather": 0}

    def doing(self, what: str) -> None:
        """Name the work the next waits are for, in stall reports (collective_watch.py)."""
        if self.waiter.watch is not None:
            self.waiter.watch.what = what

    def split_control(self, watch) -> None:
        """Give the control plane a waiter (and `watch`) of its own, for a data plane
        that runs on another thread (execution/lane.py). Both poll: two threads never
        block on the failure channel's one posted receive."""
        data = self.waiter
        data.polite = True
        self.control_waiter = Waiter(True, watch, data.channel, data.links)
        if self.host_control is not None:
            self.host_control.waiter = self.control_waiter

    # ---- control plane (small, host-side) ----
    def control_or(self, vector: np.ndarray, out: np.ndarray, idle=None,
                   urgent: bool = False) -> None:
        """idle: see Waiter.wait (given when this rank has nothing in flight). urgent: the
        vector carries flags every rank must act on (the board wakes them for it)."""
        waiter = self.control_waiter
        if waiter.watch is not None:
            waiter.watch.what = CONTROL_LABEL
        if self.board is not None:
            self.board.exchange_or(vector, out, waiter.watch, idle, urgent)
            return
        if self.host_control is not None:
            self.host_control.exchange_or(vector, out, idle, urgent)
            return
        if self.control_tcp is not None:
            out[:] = vector
            self.control_tcp.or_in_place(out)
            return
        waiter.guard()
        req = self.control_comm.Iallreduce(vector, out, op=MPI.BOR)
        waiter.wait(req, idle=idle)

    def gather_bytes(self, data: bytes, root: int = 0):
        """Every rank's `data` at `root` (a list in rank order; None elsewhere)."""
        if self.board is not None:
            return self.board.gather_bytes(data, root, self.control_waiter.watch)
        if self.host_control is not None and root == 0:
            return self.host_control.gather_bytes(data)
        if self.control_tcp is not None and root == 0:
            return self.control_tcp.gather_bytes(data)
        return gather_bytes(self.control_comm, self.control_waiter, data, root)

    def bcast_bytes(self, data, root: int = 0) -> bytes:
        """`data` from `root` (ignored elsewhere) on every rank."""
        if self.board is not None:
            return self.board.bcast_bytes(data, root, self.control_waiter.watch)
        if self.host_control is not None and root == 0:
            return self.host_control.bcast_bytes(data)
        if self.control_tcp is not None and root == 0:
            return self.control_tcp.bcast_bytes(data)
        return bcast_bytes(self.control_comm, self.control_waiter, data, root)

    def allgather_ints(self, values: np.ndarray) -> np.ndarray:
        """Every rank's int64 `values` (same length everywhere), one row per rank."""
        out = np.empty((self.size, values.size), dtype=np.int64)
        self.control_waiter.guard()
        self.control_waiter.wait(self.control_comm.Iallgather(np.ascontiguousarray(values, np.int64),
                                                      out))
        return out

    # ---- data plane ----
    def allreduce(self, buf: np.ndarray, op, postscale: float, what: str = "") -> None:
        """`what` names the tensors in a stall report, e.g. "tensor 'w'"."""
        if self.shared_memory is not None and buf.size:
            self.paths["shared_memory"] += 1
            self.shared_memory.allreduce(buf, buf, op, postscale, what, self.waiter.watch)
        elif self.hierarchical_allreduce is not None:
            self.paths["hierarchical"] += 1
            self.hierarchical_allreduce.allreduce(buf, op, postscale)
        else:
            self.paths["ring"] += 1
            self.ring.allreduce(buf, op, postscale)

    def allreduce_from(self, src: np.ndarray, dst: np.ndarray, op, postscale: float,
                       what: str = "") -> None:
        if self.shared_memory is not None and src.size:
            self.paths["shared_memory"] += 1
            self.shared_memory.allreduce(src, dst, op, postscale, what, self.waiter.watch)
        elif self.hierarchical_allreduce is not None:
            self.paths["hierarchical"] += 1
            self.hierarchical_allreduce.allreduce_from(src, dst, op, postscale)
        else:
            self.paths["ring"] += 1
            self.ring.allreduce_from(src, dst, op, postscale)

    @property
    def reads_parts(self) -> bool:
        """Whether allreduce_parts can read a fused batch's members where they lie."""
        return self.shared_memory is not None

    def allreduce_parts(self, parts: Sequence[np.ndarray], dst: np.ndarray, op,
                        postscale: float, what: str = "") -> None:
        """dst = allreduce of the concatenated 1-D `parts` (a fused batch's members),
        read where they lie: through shared memory only (reads_parts); the other
        paths reduce in place, in a buffer the members are packed into first."""
        self.paths["shared_memory"] += 1
        self.shared_memory.allreduce(parts, dst, op, postscale, what, self.waiter.watch)

    def reducescatter(self, buf: np.ndarray, bounds: List[int], op, postscale: float) -> None:
        self.ring.scatter_reduce(buf, bounds, op, postscale)

    def allgather(self, buf: np.ndarray, bounds: List[int]) -> None:
        """buf is bytes; this rank's part already sits at bounds[rank]."""
        if self.hierarchical_allgather is not None:
            self.paths["hierarchical_allgather"] += 1
            self.hierarchical_allgather.allgather(buf, bounds)
        else:
            self.paths["ring_allgather"] += 1
            self.ring.allgather(buf, bounds)

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        if self.size > 1 and buf.nbytes:
            self.waiter.guard()
            self.waiter.wait(self.data_comm.Ibcast(buf, root=root))

    def alltoall(self, send: np.ndarray, send_rows: np.ndarray, row_bytes: int):
        """Rows to each rank from `send` (bytes); returns (received bytes, rows from each rank)."""
        n, r = self.size, self.rank
        recv_rows = np.empty(n, dtype=np.int64)
        self.waiter.guard()
        self.waiter.wait(self.data_comm.Ialltoall(np.ascontiguousarray(send_rows, dtype=np.int64),
                                                  recv_rows))
        send_off = np.concatenate(([0], np.cumsum(send_rows))) * row_bytes
        recv_off = np.concatenate(([0], np.cumsum(recv_rows))) * row_bytes
        recv = np.empty(int(recv_off[-1]), dtype=np.uint8)
        recv[recv_off[r]:recv_off[r + 1]] = send[send_off[r]:send_off[r + 1]]
        for k in range(1, n):
            dest, source = (r + k) % n, (r - k) % n
            self.link.sendrecv(send[send_off[dest]:send_off[dest + 1]],
                               recv[recv_off[source]:recv_off[source + 1]],
                               dest=dest, source=source)
        return recv, recv_rows

    def close(self) -> None:
        """Collective: only when every rank stops together."""
        if self.shared_memory is not None:
            self.shared_memory.close()
            self.shared_memory = None
        if self.board is not None:
            self.board.close()
            self.board = None
        if self.host_control is not None:
            self.host_control.close()
            self.host_control = None
        for hier in {id(h): h for h in (self.hierarchical_allreduce, self.hierarchical_allgather)
                     if h is not None}.values():
            hier.close()
        self.hierarchical_allreduce = self.hierarchical_allgather = None
        if self.cross_host is not None:
            self.cross_host.close()
            self.cross_host = None
        self.control_tcp = None  # (its connections were the mesh's)
        for comm in (self.data_comm, self.control_comm):
            try:
                comm.Free()
            except MPI.Exception:
                pass
