"""Allreduce and allgather that cross the network once per host, not once per rank.

With several ranks per host, one ring of all ranks sends every byte over the
hosts' links about 2(n-1)/n times per host *link*, as if each rank had its own.
Here each host first reduces inside itself, then local rank l of every host
allreduces part l of the buffer with the local rank l of the other hosts (the
local_size cross-host rings run at once, each on 1/local_size of the buffer),
then the host spreads the parts again. Per host, the link then carries
2(h-1)/h of the buffer for h hosts: with 2 hosts x 2 ranks, 1 buffer instead
of 1.5.

The allreduce is cut into chunks that go through the three phases as a
pipeline: while the host reduces chunk k+1, chunk k crosses the network and
chunk k-1 is spread in the host, so the link stays busy and the in-host
phases hide behind it. Each chunk's messages carry their own tag, and the
rings of the chunks in flight are driven together (`drive`), each one a
generator of the requests it waits for (ring.Ring.steps).

Allgather the same way (not pipelined): the host gathers its ranks' rows,
local rank 0 of each host exchanges the host's rows with the others, and the
host broadcasts the whole. It needs every host to hold the same number of
ranks, laid out in blocks (ranks 0..k-1 on the first host...), which is what
both MPIs' default mapping gives; otherwise the flat ring is used.
"""
from __future__ import annotations

import logging
from typing import Iterable, Iterator, Optional, Sequence

import numpy as np
from ..core.mpi_library import MPI

from ..core import kernels
from ..core.hosts import split_by_host
from .ring import Ring, even_bounds
from ..core.settings import env_value
from .mpi import PointToPoint

__all__ = ["Hierarchical", "open_hierarchical"]

_log = logging.getLogger("horolite.transport.hierarchical")

# The allreduce's chunks, and how many run at once (the pipeline's depth: one in each phase).
CHUNK_BYTES = 8 << 20
IN_FLIGHT = 3
# Chunk c's messages carry tag TAG_BASE + c % TAGS: only IN_FLIGHT chunks run at once,
# so chunks that share a tag never overlap.
TAG_BASE, TAGS = 100, 4096


def drive(waiter, schedules: Iterable[Iterator], in_flight: int) -> None:
    """Run generators of MPI requests (ring.Ring.steps) together, at most `in_flight` at
    once, in order: each is resumed when the request it yielded has completed."""
    upcoming = iter(schedules)
    blocked = []  # (request, its generator)

    def advance(gen) -> None:
        for req in gen:
            if not req.Test():
                blocked.append((req, gen))
                return
        start_next()

    def start_next() -> None:
        gen = next(upcoming, None)
        if gen is not None:
            advance(gen)

    for _ in range(in_flight):
        start_next()
    while blocked:
        index = waiter.wait_any([req for req, _ in blocked])
        advance(blocked.pop(index)[1])


class Hierarchical:
    """Collectives over a host communicator (`local`) and a cross-host one (`cross`)."""

    def __init__(self, local: MPI.Comm, cross: MPI.Comm, waiter, job_rank: int):
        self.local_comm, self.cross_comm = local, cross
        self.local = Ring(PointToPoint(local, _JobRanks(waiter, local.allgather(job_rank))))
        self.cross = Ring(PointToPoint(cross, _JobRanks(waiter, cross.allgather(job_rank))))
        self.local_rank, self.local_size = local.Get_rank(), local.Get_size()
        self.cross_rank, self.cross_size = cross.Get_rank(), cross.Get_size()
        self._waiter = waiter
        # What waits on the rings' requests: the MPI waiter, or a TCP link (transport/tcp.py).
        self.driver = waiter

    def allreduce(self, buf: np.ndarray, op, postscale: float) -> None:
        """Reduce `buf` (1-D, contiguous) in place over every rank of every host."""
        if buf.size == 0:
            return
        chunks = even_bounds(buf.size, max(1, -(-buf.nbytes // CHUNK_BYTES)))
        lanes = list(range(IN_FLIGHT))  # scratch of the rings, one per chunk in flight
        drive(self.driver, (self._chunk(buf[lo:hi], c, op, postscale, lanes)
                             for c, (lo, hi) in enumerate(zip(chunks, chunks[1:]))), IN_FLIGHT)

    def _chunk(self, part: np.ndarray, c: int, op, postscale: float, lanes) -> Iterator:
        """One chunk through the three phases: the requests it waits for."""
        tag, lane = TAG_BASE + c % TAGS, lanes.pop()
        bounds = even_bounds(part.size, self.local_size)
        if self.local_size > 1:  # part local_rank: this host's sum
            yield from self.local.steps(part, part, bounds, op, 1.0, True, False, tag, lane)
        mine = part[bounds[self.local_rank]:bounds[self.local_rank + 1]]
        if mine.size and self.cross_size > 1:  # part local_rank: everyone's
            yield from self.cross.steps(mine, mine, even_bounds(mine.size, self.cross_size),
                                        op, postscale, True, True, tag, lane)
        elif mine.size and postscale != 1.0:
            kernels.scale_into(mine, mine, postscale)
        if self.local_size > 1:
            yield from self.local.steps(part, part, bounds, None, 1.0, False, True, tag, lane)
        lanes.append(lane)

    def allreduce_from(self, src: np.ndarray, dst: np.ndarray, op, postscale: float) -> None:
        np.copyto(dst, src)
        self.allreduce(dst, op, postscale)

    def allgather(self, buf: np.ndarray, bounds: Sequence[int]) -> None:
        """buf is bytes; world rank r's part sits at bounds[r] on rank r, and everywhere after."""
        k, h = self.local_size, self.cross_size
        host = self.cross_rank
        # The host's ranks are world ranks host*k .. host*k+k-1: gather their parts.
        first = host * k
        self.local.allgather(buf[bounds[first]:bounds[first + k]],
                             [b - bounds[first] for b in bounds[first:first + k + 1]])
        # Local rank 0 of every host swaps whole hosts' parts, then each host broadcasts.
        if self.local_rank == 0 and h > 1:
            host_bounds = [bounds[i * k] for i in range(h + 1)]
            self.cross.allgather(buf, host_bounds)
        if k > 1:
            self._waiter.guard()
            self._waiter.wait(self.local_comm.Ibcast(buf, root=0))

    def close(self) -> None:
        for comm in (self.local_comm, self.cross_comm):
            try:
                comm.Free()
            except MPI.Exception:
                pass


def _layout(comm: MPI.Comm, local: MPI.Comm) -> Optional[str]:
    """Why the hierarchical path cannot serve this job, or None."""
    sizes = comm.allgather((local.Get_size(), comm.Get_rank() - local.Get_rank()))
    local_sizes = {k for k, _ in sizes}
    if len(local_sizes) != 1:
        return f"hosts hold different numbers of ranks ({sorted(local_sizes)})"
    k = local_sizes.pop()
    if k == 1:
        return "one rank per host"
    if k == comm.Get_size():
        return "every rank is on one host"
    if any(first != (r // k) * k for r, (_, first) in enumerate(sizes)):
        return "ranks are not laid out in blocks of one host"  # e.g. round-robin mapping
    return None


class _JobRanks:
    """The waiter, told the job's rank of the peer waited for (a stall report names job
    ranks) instead of its number in the host or cross-host communicator."""

    def __init__(self, waiter, ranks: Sequence[int]):
        self._waiter, self._ranks = waiter, list(ranks)
        self.guard = waiter.guard

    def wait(self, req, peer: int = -1) -> None:
        self._waiter.wait(req, self._ranks[peer] if peer >= 0 else peer)

    def wait_all(self, reqs, peer: int = -1) -> None:
        self._waiter.wait_all(reqs, self._ranks[peer] if peer >= 0 else peer)


def open_hierarchical(comm: MPI.Comm, waiter, allreduce: bool, allgather: bool):
    """(Hierarchical or None for allreduce, the same for allgather). Collective.

    Where the layout does not allow it (one host, one rank per host, hosts of
    different sizes) the flat ring serves; logged as a warning if it was asked for
    in the environment, not when it is only the default."""
    if not allreduce and not allgather:
        return None, None
    local = split_by_host(comm)
    why = _layout(comm, local)
    if why is not None:
        asked = any(env_value(name) is not None for name, on in
                    (("HIERARCHICAL_ALLREDUCE", allreduce), ("HIERARCHICAL_ALLGATHER", allgather))
                    if on)
        if comm.Get_rank() == 0:
            (_log.warning if asked else _log.debug)(
                "rank %d: hierarchical collectives %snot used: %s", comm.Get_rank(),
                "asked for but " if asked else "", why)
        local.Free()
        return None, None
    cross = comm.Split(color=local.Get_rank(), key=comm.Get_rank())
    hier = Hierarchical(local, cross, waiter, comm.Get_rank())
    _log.info("rank %d: hierarchical allreduce %s, allgather %s (%d hosts x %d ranks)",
              comm.Get_rank(), "on" if allreduce else "off", "on" if allgather else "off",
              hier.cross_size, hier.local_size)
    return (hier if allreduce else None), (hier if allgather else None)
