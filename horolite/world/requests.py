"""mpi4py's Request and Status for the world without MPI: what a receive or send
returns, tested and waited on as MPI's are; a receive's request is completed by the
mesh's reader thread (sockets_mesh.py), which wakes the waiters through the mesh."""
from __future__ import annotations

from typing import List, Optional, Tuple

__all__ = ["ANY_SOURCE", "Request", "RecvRequest", "REQUEST_NULL", "Status"]

ANY_SOURCE = -1


class Status:
    """Where a completed receive came from and how many bytes it took."""

    def __init__(self):
        self.source, self.tag, self.count = -1, -1, 0

    def Get_source(self) -> int:
        return self.source

    def Get_tag(self) -> int:
        return self.tag

    def Get_count(self, datatype=None) -> int:
        return self.count


class Request:
    """mpi4py's Request, for this world: Test/Wait, and once seen complete it equals
    REQUEST_NULL, as an MPI request handle does."""

    def __init__(self, mesh):  # (the sockets_mesh.Mesh that completes it; None: done)
        self.mesh = mesh
        self.done = mesh is None
        self.error: Optional[BaseException] = None
        self.seen = mesh is None
        self.source, self.tag, self.count = -1, -1, 0

    # -- progress: a plain request is completed by the mesh; composites override --
    def advance(self) -> bool:
        return self.done

    def Test(self, status: Optional[Status] = None) -> bool:
        if not self.advance():
            return False
        if self.error is not None:
            self.seen = True
            raise self.error
        if status is not None:
            status.source, status.tag, status.count = self.source, self.tag, self.count
        self.seen = True
        return True

    def Wait(self, status: Optional[Status] = None) -> None:
        Request.Waitall([self])
        if status is not None:
            status.source, status.tag, status.count = self.source, self.tag, self.count

    def Cancel(self) -> None:
        """A receive not yet matched is withdrawn; one failed by a lost peer is then done."""
        if self.mesh is not None and not self.seen:
            self.mesh.cancel(self)
            self.error = None

    def Free(self) -> None:
        self.Cancel()
        self.seen = True

    def __eq__(self, other) -> bool:
        if other is REQUEST_NULL or self is REQUEST_NULL:
            return (self.seen if other is REQUEST_NULL else other.seen)
        return self is other

    def __ne__(self, other) -> bool:
        return not self == other

    __hash__ = object.__hash__

    def __bool__(self) -> bool:
        return not self.seen

    # -- mpi4py's class-level waits --
    @staticmethod
    def Testall(reqs, statuses=None) -> bool:
        if all(r.seen or r.advance() for r in reqs):
            for r in reqs:
                if not r.seen:
                    r.Test()
            return True
        return False

    @staticmethod
    def Testany(reqs, status: Optional[Status] = None) -> Tuple[int, bool]:
        live = [i for i, r in enumerate(reqs) if not r.seen]
        if not live:
            return -32766, True  # MPI_UNDEFINED: nothing active
        for i in live:
            if reqs[i].Test(status):
                return i, True
        return -32766, False

    @staticmethod
    def Testsome(reqs, statuses=None) -> Optional[List[int]]:
        live = [i for i, r in enumerate(reqs) if not r.seen]
        if not live:
            return None
        done = []
        for i in live:
            r = reqs[i]
            if r.advance() and r.error is None:
                r.Test()
                done.append(i)
        return done

    @staticmethod
    def Waitany(reqs, status: Optional[Status] = None) -> int:
        mesh = _mesh_of(reqs)
        while True:
            version = mesh.version if mesh is not None else 0
            index, flag = Request.Testany(reqs, status)
            if flag:
                return index
            mesh.wait_change(version)

    @staticmethod
    def Waitall(reqs, statuses=None) -> None:
        mesh = _mesh_of(reqs)
        while True:
            version = mesh.version if mesh is not None else 0
            if Request.Testall(reqs):
                return
            mesh.wait_change(version)


def _mesh_of(reqs):
    for r in reqs:
        if r.mesh is not None:
            return r.mesh
    return None


REQUEST_NULL = Request(None)


class RecvRequest(Request):
    def __init__(self, mesh, buf, context: int, source: int, tag: int):
        super().__init__(mesh)
        self.view = memoryview(buf).cast("B") if buf is not None else None
        self.context, self.want, self.tag = context, source, tag
        self.data: Optional[bytes] = None  # an object receive (view None) gets bytes

    def matches(self, context: int, source: int, tag: int) -> bool:
        return (self.context == context and self.tag == tag
                and self.want in (ANY_SOURCE, source))
