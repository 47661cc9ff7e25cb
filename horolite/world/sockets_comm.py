"""Communicators of a job started without MPI: mpi4py's Comm, as much of it as horolite uses.

A communicator is a list of job ranks and a context, a number every member derives
alike (from its parent's context and the split's order), so its messages never meet
another communicator's. Collectives run in call order, as MPI requires of every
member, each under a tag of its own. The nonblocking ones are steps (a generator
that yields the requests it waits on), advanced whenever the caller tests them, so
the runtime's waits (polling, watching for failures and stalls) work as over MPI.
Set-up collectives go through rank 0 in two hops: they are small and happen once.
"""
from __future__ import annotations

import hashlib
import itertools
import mmap
import os
import socket
import threading
from typing import Any, Callable, Generator, List, Optional, Sequence

import numpy as np

from . import codec
from .requests import ANY_SOURCE, RecvRequest, Request
from .sockets_mesh import Mesh

__all__ = ["Comm", "Group", "Op", "Win", "COMM_NULL", "UNDEFINED", "IN_PLACE", "BYTE",
           "LAND", "LOR", "BOR", "BAND", "SUM", "MAX", "MIN", "COMM_TYPE_SHARED", "SocketWorldError"]

UNDEFINED = -32766
COMM_TYPE_SHARED = 1


class SocketWorldError(RuntimeError):
    """MPI.Exception's place in this world."""


def processor_name() -> str:
    """MPI_Get_processor_name's answer here: the host's name."""
    return socket.gethostname()


class _Marker:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


IN_PLACE = _Marker("IN_PLACE")
BYTE = _Marker("BYTE")


class Op:
    def __init__(self, name: str, objects: Callable[[Any, Any], Any], arrays: Callable):
        self.name, self.objects, self.arrays = name, objects, arrays

    def __repr__(self) -> str:
        return self.name


LAND = Op("LAND", lambda a, b: bool(a) and bool(b), np.logical_and)
LOR = Op("LOR", lambda a, b: bool(a) or bool(b), np.logical_or)
BOR = Op("BOR", lambda a, b: a | b, np.bitwise_or)
BAND = Op("BAND", lambda a, b: a & b, np.bitwise_and)
SUM = Op("SUM", lambda a, b: a + b, np.add)
MAX = Op("MAX", lambda a, b: max(a, b), np.maximum)
MIN = Op("MIN", lambda a, b: min(a, b), np.minimum)

_COLL_TAG = -(1 << 40)  # collectives' tags count down from here; users' tags are >= 0


def _context(parent: int, *parts) -> int:
    digest = hashlib.sha256(repr((parent,) + parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _bytes_of(buf) -> memoryview:
    """What a send carries (a non-contiguous array is copied into order)."""
    if isinstance(buf, (list, tuple)):
        buf = buf[0]
    return memoryview(np.ascontiguousarray(buf)).cast("B")


def _into(buf) -> memoryview:
    """Where a receive lands: the caller's own memory, never a copy (a non-contiguous
    buffer is refused by memoryview.cast rather than filled in a copy nobody reads)."""
    if isinstance(buf, (list, tuple)):
        buf = buf[0]
    return memoryview(buf).cast("B")


class Group:
    def __init__(self, ranks: Sequence[int]):
        self.ranks = list(ranks)  # job ranks

    def Incl(self, ranks: Sequence[int]) -> "Group":
        return Group([self.ranks[r] for r in ranks])

    def Get_size(self) -> int:
        return len(self.ranks)


class Comm:
    """The members' job ranks in this communicator's order, and its context."""

    def __init__(self, mesh: Mesh, ranks: Sequence[int], context: int):
        self.mesh, self.ranks, self.context = mesh, list(ranks), context
        self._rank = self.ranks.index(mesh.rank)
        self._calls = itertools.count()
        self._children = itertools.count()
        self._groups = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<horolite sockets Comm rank {self._rank} of {self.ranks}>"

    def Get_rank(self) -> int:
        return self._rank

    def Get_size(self) -> int:
        return len(self.ranks)

    def Get_group(self) -> Group:
        return Group(self.ranks)

    # -- point to point (ranks are this communicator's) --
    def Isend(self, buf, dest: int, tag: int = 0) -> Request:
        self.mesh.send(self.context, self.ranks[dest], tag, _bytes_of(buf))
        req = Request(self.mesh)
        req.done = True
        return req

    def Irecv(self, buf, source: int = ANY_SOURCE, tag: int = 0) -> RecvRequest:
        return self._recv(_into(buf), source, tag)

    def _recv(self, view, source: int, tag: int) -> RecvRequest:
        want = ANY_SOURCE if source == ANY_SOURCE else self.ranks[source]
        req = _LocalRecv(self, view, want, tag)
        self.mesh.post(req)
        return req

    def send(self, obj, dest: int, tag: int = 0) -> None:
        self.mesh.send(self.context, self.ranks[dest], tag, codec.encode(obj))

    def recv(self, buf=None, source: int = ANY_SOURCE, tag: int = 0):
        req = self._recv(None, source, tag)
        req.Wait()
        return codec.decode(req.data)

    # -- collectives: every member calls them in the same order --
    def _tag(self) -> int:
        with self._lock:
            return _COLL_TAG - next(self._calls)

    def _run(self, steps: Generator) -> Any:
        req = _Steps(self.mesh, steps)
        req.Wait()
        return req.value

    def _gather_steps(self, data: bytes, root: int, tag: int):
        """Every member's bytes at `root` (a list there, None elsewhere)."""
        if self._rank != root:
            self.mesh.send(self.context, self.ranks[root], tag, data)
            return None
        recvs = [self._recv(None, q, tag) if q != root else None for q in range(len(self.ranks))]
        yield [r for r in recvs if r is not None]
        return [data if r is None else r.data for r in recvs]

    def _bcast_steps(self, data: Optional[bytes], root: int, tag: int):
        if self._rank == root:
            for q in range(len(self.ranks)):
                if q != root:
                    self.mesh.send(self.context, self.ranks[q], tag, data)
            return data
        req = self._recv(None, root, tag)
        yield [req]
        return req.data

    def _allgather_steps(self, data: bytes, tag: int):
        parts = yield from _maybe(self._gather_steps(data, 0, tag))
        joined = yield from _maybe(self._bcast_steps(
            codec.encode(parts) if self._rank == 0 else None, 0, tag))
        return codec.decode(joined)

    def allgather(self, obj) -> list:
        return [codec.decode(p) for p in self._run(self._allgather_steps(codec.encode(obj),
                                                                         self._tag()))]

    def gather(self, obj, root: int = 0):
        parts = self._run(_maybe(self._gather_steps(codec.encode(obj), root, self._tag())))
        return None if parts is None else [codec.decode(p) for p in parts]

    def bcast(self, obj=None, root: int = 0):
        data = codec.encode(obj) if self._rank == root else None
        return codec.decode(self._run(_maybe(self._bcast_steps(data, root, self._tag()))))

    def allreduce(self, obj, op: Op = SUM):
        values = self.allgather(obj)
        out = values[0]
        for v in values[1:]:
            out = op.objects(out, v)
        return out

    def alltoall(self, objs: Sequence) -> list:
        rows = self.allgather([codec.encode(o) for o in objs])
        return [codec.decode(rows[q][self._rank]) for q in range(len(self.ranks))]

    def Barrier(self) -> None:
        self.allgather(None)

    def Bcast(self, buf, root: int = 0) -> None:
        self.Ibcast(buf, root).Wait()

    def Ibcast(self, buf, root: int = 0) -> Request:
        view = _into(buf)

        def steps():
            data = yield from _maybe(self._bcast_steps(view.tobytes() if self._rank == root
                                                        else None, root, tag))
            if self._rank != root:
                view[:] = data
        tag = self._tag()
        return _Steps(self.mesh, steps())

    def Iallreduce(self, sendbuf, recvbuf, op: Op = SUM) -> Request:
        out = np.asarray(recvbuf[0] if isinstance(recvbuf, (list, tuple)) else recvbuf)
        mine = (out if sendbuf is IN_PLACE else np.asarray(sendbuf)).copy()
        tag = self._tag()

        def steps():
            rows = yield from self._allgather_steps(mine.tobytes(), tag)
            total = np.frombuffer(rows[0], dtype=mine.dtype).reshape(mine.shape).copy()
            for row in rows[1:]:
                op.arrays(total, np.frombuffer(row, dtype=mine.dtype).reshape(mine.shape),
                          out=total)
            out[...] = total
        return _Steps(self.mesh, steps())

    def Iallgather(self, sendbuf, recvbuf) -> Request:
        mine = _bytes_of(sendbuf).tobytes()
        out = _into(recvbuf)
        tag = self._tag()

        def steps():
            rows = yield from self._allgather_steps(mine, tag)
            out[:] = b"".join(rows)
        return _Steps(self.mesh, steps())

    def Ialltoall(self, sendbuf, recvbuf) -> Request:
        mine = _bytes_of(sendbuf).tobytes()
        out = _into(recvbuf)
        n = len(self.ranks)
        tag = self._tag()

        def steps():
            rows = yield from self._allgather_steps(mine, tag)
            width = len(mine) // n
            out[:] = b"".join(rows[q][self._rank * width:(self._rank + 1) * width]
                              for q in range(n))
        return _Steps(self.mesh, steps())

    def Igather(self, sendbuf, recvbuf, root: int = 0) -> Request:
        return self.Igatherv(sendbuf, recvbuf, root)

    def Igatherv(self, sendbuf, recvbuf, root: int = 0) -> Request:
        """recvbuf at root: an array, or [array, counts, displacements, BYTE]."""
        mine = _bytes_of(sendbuf).tobytes()
        tag = self._tag()

        def steps():
            parts = yield from _maybe(self._gather_steps(mine, root, tag))
            if parts is None:
                return
            if isinstance(recvbuf, (list, tuple)):
                out = _into(recvbuf[0])
                for part, at in zip(parts, recvbuf[2]):
                    out[int(at):int(at) + len(part)] = part
            else:
                _into(recvbuf)[:] = b"".join(parts)
        return _Steps(self.mesh, steps())

    # -- new communicators --
    def Split(self, color: int = 0, key: int = 0) -> "Comm":
        seq = next(self._children)
        pairs = self.allgather((color, key))
        if color == UNDEFINED:
            return COMM_NULL
        members = sorted((k, q) for q, (c, k) in enumerate(pairs) if c == color)
        return Comm(self.mesh, [self.ranks[q] for _, q in members],
                    _context(self.context, "split", seq, color))

    def Split_type(self, split_type: int = COMM_TYPE_SHARED, key: int = 0, info=None) -> "Comm":
        hosts = self.allgather(processor_name())
        return self.Split(sorted(set(hosts)).index(hosts[self._rank]), key)

    def Dup(self) -> "Comm":
        return self.Split(0, self._rank)

    def Create_group(self, group: Group, tag: int = 0) -> "Comm":
        """Collective over `group`'s members only, as MPI_Comm_create_group."""
        ranks = tuple(group.ranks)
        with self._lock:
            n = self._groups.get(ranks, 0)
            self._groups[ranks] = n + 1
        return Comm(self.mesh, ranks, _context(self.context, "group", ranks, n, tag))

    def Free(self) -> None:
        pass


def _maybe(result):
    """`yield from` a step generator, or take a value a step function returned at once."""
    if isinstance(result, Generator):
        value = yield from result
        return value
    return result


class _NullComm:
    def __eq__(self, other) -> bool:
        return other is self

    __hash__ = object.__hash__

    def Free(self) -> None:
        pass


COMM_NULL = _NullComm()


class _LocalRecv(RecvRequest):
    def __init__(self, comm: Comm, view, want: int, tag: int):
        super().__init__(comm.mesh, view, comm.context, want, tag)
        self._comm = comm

    @property
    def source_in_comm(self) -> int:
        return self._comm.ranks.index(self.source) if self.source >= 0 else -1

    def Test(self, status=None) -> bool:
        done = super().Test(None)
        if done and status is not None:  # (the source as this communicator numbers it)
            status.source, status.tag, status.count = self.source_in_comm, self.tag, self.count
        return done


class _Steps(Request):
    """A nonblocking collective: its generator runs on until it waits on requests not done."""

    def __init__(self, mesh: Mesh, steps: Generator):
        super().__init__(mesh)
        self._steps = steps
        self._waiting: List[Request] = []
        self.value = None
        self.advance()

    def advance(self) -> bool:
        while not self.done:
            for r in self._waiting:
                if not r.advance():
                    return False
                if r.error is not None:
                    self.error, self.done = r.error, True
                    return True
            try:
                self._waiting = list(next(self._steps))
            except StopIteration as stop:
                self.value, self.done = stop.value, True
            except BaseException as e:  # (a lost peer while sending, say)
                self.error, self.done = e, True
        return True


class Win:
    """MPI.Win.Allocate_shared: one /dev/shm segment for the members (all on this host),
    each member's part at its own offset; the file is unlinked once all have mapped it."""

    def __init__(self, mm: mmap.mmap, offsets: List[int], sizes: List[int], disp: int):
        self._mm, self._offsets, self._sizes, self._disp = mm, offsets, sizes, disp

    @classmethod
    def Allocate_shared(cls, nbytes: int, disp_unit: int = 1, info=None, comm: Comm = None):
        sizes = comm.allgather(int(nbytes))
        offsets, at = [], 0
        for n in sizes:
            offsets.append(at)
            at += (n + 4095) // 4096 * 4096
        total = max(at, 4096)
        name = None
        if comm.Get_rank() == 0:
            name = "/dev/shm/horolite-win-%d-%s" % (os.getpid(), os.urandom(6).hex())
            with open(name, "wb") as f:
                f.truncate(total)
        name = comm.bcast(name, 0)
        with open(name, "r+b") as f:
            mm = mmap.mmap(f.fileno(), total)
        comm.Barrier()
        if comm.Get_rank() == 0:
            os.unlink(name)
        return cls(mm, offsets, sizes, disp_unit)

    def Shared_query(self, rank: int):
        at = self._offsets[rank]
        return memoryview(self._mm)[at:at + max(self._sizes[rank], 1)], self._disp

    def Free(self) -> None:
        try:
            self._mm.close()
        except BufferError:
            pass  # views still in use: unmapped when they go
