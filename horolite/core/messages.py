"""What ranks tell the coordinator (Request) and what it answers (Response).

Both are small and travel on the control path only, in the binary layout of
wire.py (never pickled); tensor data never goes through them. A field added here
is one line in wire.py's table.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional, Tuple

__all__ = ["Kind", "Request", "Response", "JOIN_NAME"]

# The name join() travels under: not one a user would pick for a tensor.
JOIN_NAME = "horolite.join"


class Kind(enum.IntEnum):
    ALLREDUCE = 0
    ALLGATHER = 1
    BROADCAST = 2
    JOIN = 3
    ALLTOALL = 5
    BARRIER = 6
    REDUCESCATTER = 7

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(slots=True)
class Request:
    """One rank's description of a tensor it submitted."""
    name: str
    kind: Kind
    dtype: str
    shape: Tuple[int, ...]
    op: int = 0
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    device: str = "cpu"
    # A grouped allreduce sent as one request: the shapes of its members.
    group: Tuple[Tuple[int, ...], ...] = ()
    # Quorum allreduce (quorum.py): done once this many ranks have submitted; 0: all of them.
    quorum: int = 0
    # Non-empty: this rank will never send this tensor (why); every rank's request for it
    # fails with the reason (a step abandoned after some of its buckets left: api/buckets.py).
    # A notice for `N` also covers `N.0`, `N.1`, ... sent with `members` (coordination/abandon.py).
    abandoned: str = ""
    # > 0: this request is `<group>.<k>`, one of the `members` requests of a grouped
    # allreduce that could not be packed into one (api/collectives.py); 0: not.
    members: int = 0

    def signature(self) -> tuple:
        """Everything but the name: equal signatures mean a cached response still fits."""
        return (self.kind, self.dtype, self.shape, self.op, self.root,
                self.prescale, self.postscale, self.device, self.group, self.quorum,
                self.abandoned, self.members)


@dataclass
class Response:
    """The coordinator's decision for one tensor, identical on every rank."""
    kind: Kind
    name: str
    dtype: str = ""
    shape: Tuple[int, ...] = ()
    op: int = 0
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    device: str = "cpu"
    # Allgather: every rank's first dimension, in rank order.
    first_dims: Optional[Tuple[int, ...]] = None
    # Ranks that had joined when this tensor was decided (they contribute zeros).
    joined: Tuple[int, ...] = ()
    # Set when the ranks disagree: the message every rank raises.
    error: Optional[str] = None
    error_type: str = "mismatch"
    # JOIN: the last rank that joined.
    last_joined: int = -1
    # Quorum allreduce (quorum.py): the ranks whose inputs were reduced, and the ranks
    # whose requests were part of the decision (the others answer a later submission
    # of this name with the result). Both empty for any other collective.
    contributors: Tuple[int, ...] = ()
    present: Tuple[int, ...] = ()
    # error_type "abandoned": the rank that will never send the tensor (the peer named).
    peer: int = -1
    # Response-cache slot the tensor was answered from (-1: negotiated in full).
    cache_slot: int = field(default=-1, compare=False)

    def total_postscale(self, size: int) -> float:
        """The postscale with Average's 1/size folded in (one multiply, in the last step)."""
        return self.postscale / size if self.op == 0 else self.postscale  # 0: ReduceOp.AVERAGE

    @classmethod
    def from_request(cls, req: Request, **extra) -> "Response":
        return cls(kind=req.kind, name=req.name, dtype=req.dtype, shape=req.shape, op=req.op,
                   root=req.root, prescale=req.prescale, postscale=req.postscale,
                   device=req.device, **extra)
