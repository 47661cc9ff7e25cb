"""Negotiation: rank 0 decides which tensors are ready on every rank.

Pure logic, no MPI: the runtime gathers each rank's new requests, feeds them to
the Coordinator on rank 0 and broadcasts the ordered responses it returns.
Mismatch messages name the ranks on each side, which Horovod's do not.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from . import quorum
from .abandon import settled
from ..core.messages import JOIN_NAME, Kind, Request, Response
from ..core.ops import ReduceOp

__all__ = ["Coordinator", "check_requests", "format_ranks"]


def format_ranks(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    word = "rank" if len(ranks) == 1 else "ranks"
    return f"{word} {', '.join(str(r) for r in ranks)}"


def _describe(field: str, value) -> str:
    if field == "kind":
        return Kind(value).label
    if field == "op":
        try:
            return ReduceOp(value).name.capitalize()
        except ValueError:
            return str(value)
    if field == "shape":
        return str(tuple(value))
    if field == "group":
        return "[" + ", ".join(str(tuple(v)) for v in value) + "]" if value else "no group"
    return str(value)


def _disagreement(field: str, label: str, by_rank: Dict[int, object]) -> Optional[str]:
    """'rank 0, 2 had float32, rank 1 had int32', or None when all agree."""
    groups: "OrderedDict[object, List[int]]" = OrderedDict()
    for rank in sorted(by_rank):
        groups.setdefault(by_rank[rank], []).append(rank)
    if len(groups) <= 1:
        return None
    parts = [f"{format_ranks(ranks)} had {_describe(field, value)}" for value, ranks in groups.items()]
    return f"mismatched {label}: " + ", ".join(parts)


def abandoned_response(name: str, first: Request, gone: Dict[int, str]) -> Response:
    """The error every rank raises for tensor `name`, which the ranks in `gone` (rank ->
    why) will never send: not a mismatch but a peer's failure, naming the first of them."""
    return Response(kind=first.kind, name=name, error_type="abandoned", peer=min(gone),
                    error=f"tensor '{name}': {format_ranks(gone)} will never send it: "
                          f"{gone[min(gone)]}")


def check_requests(name: str, requests: Dict[int, Request], size: int,
                   joined: Iterable[int] = ()) -> Response:
    """Validate one tensor's requests from every participating rank."""
    joined = tuple(sorted(joined))
    first = requests[min(requests)]

    def fail(message: str, error_type: str = "mismatch") -> Response:
        return Response(kind=first.kind, name=name, error=f"tensor '{name}': {message}",
                        error_type=error_type)

    gone = {r: q.abandoned for r, q in requests.items() if q.abandoned}
    if gone:
        return abandoned_response(name, first, gone)

    for field, label in (("kind", "collective"), ("dtype", "dtype"), ("device", "device"),
                         ("op", "reduce op"), ("root", "root rank"),
                         ("prescale", "prescale factor"), ("postscale", "postscale factor"),
                         ("quorum", "quorum")):
        problem = _disagreement(field, label, {r: getattr(q, field) for r, q in requests.items()})
        if problem:
            return fail(problem)

    kind = first.kind
    if kind in (Kind.ALLGATHER, Kind.ALLTOALL):
        problem = _disagreement("ndim", "number of dimensions",
                                {r: len(q.shape) for r, q in requests.items()})
        if problem:
            return fail(problem)
        if len(first.shape) == 0:
            return fail(f"{kind.label} needs at least one dimension, got a scalar", "invalid")
        problem = _disagreement("shape", "shape beyond the first dimension",
                                {r: tuple(q.shape[1:]) for r, q in requests.items()})
        if problem:
            return fail(problem)
    else:
        problem = (_disagreement("group", "group member shapes",
                                 {r: q.group for r, q in requests.items()})
                   or _disagreement("shape", "shape", {r: tuple(q.shape) for r, q in requests.items()}))
        if problem:
            return fail(problem)

    if kind == Kind.BROADCAST and not 0 <= first.root < size:
        return fail(f"root rank {first.root} is out of range for a job of {size} ranks", "invalid")
    if joined and kind not in (Kind.ALLREDUCE, Kind.BARRIER):
        verb = "has" if len(joined) == 1 else "have"
        return fail(f"{kind.label} cannot run while {format_ranks(joined)} {verb} joined; "
                    "only allreduce works with join()", "invalid")

    extra = {}
    if kind == Kind.ALLGATHER:
        extra["first_dims"] = tuple(requests[r].shape[0] if r in requests else 0 for r in range(size))
    return Response.from_request(first, joined=joined, **extra)


class Coordinator:
    """Rank 0's table of requests, and the order in which tensors become ready."""

    def __init__(self, size: int, names: Optional[Sequence[int]] = None):
        """names: how messages number the ranks (a process set's job ranks), if not 0..size-1."""
        self.size = size
        self.names = list(names) if names is not None else None
        self._table: "OrderedDict[str, Dict[int, Request]]" = OrderedDict()
        self._first_seen: Dict[str, float] = {}
        self._joined: "OrderedDict[int, None]" = OrderedDict()
        self._ready: List[str] = []
        self._notices: "OrderedDict[str, None]" = OrderedDict()  # names with an abandon notice

    def add(self, rank: int, requests: Iterable[Request], now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        for req in requests:
            if req.kind == Kind.JOIN:
                self._joined[rank] = None
                continue
            entry = self._table.get(req.name)
            if entry is None:
                entry = self._table[req.name] = {}
                self._first_seen[req.name] = now
            entry[rank] = req
            if req.abandoned:
                self._notices[req.name] = None

    @property
    def joined(self) -> Tuple[int, ...]:
        return tuple(self._joined)

    def responses(self) -> List[Response]:
        """Tensors every non-joined rank has submitted, in the order they became ready."""
        out: List[Response] = []
        expected = self.size - len(self._joined)
        if self._notices:
            out += self._abandoned()
        for name in list(self._table):
            requests = self._table[name]
            participants = len([r for r in requests if r not in self._joined])
            first = next(iter(requests.values()), None)
            if first is None or participants < quorum.needed(first, expected):
                continue
            del self._table[name]
            del self._first_seen[name]
            response = check_requests(name, requests, self.size, self._joined)
            if response.error and self.names is not None:  # the same error, in job ranks
                named = self.names
                response = check_requests(name, {named[r]: q for r, q in requests.items()},
                                          self.size, [named[r] for r in self._joined])
            if first.quorum:
                response = quorum.decide(response, list(requests), self._joined,
                                         quorum.needed(first, expected))
            out.append(response)
        if len(self._joined) == self.size:
            last = next(reversed(self._joined))
            self._joined.clear()
            out.append(Response(kind=Kind.JOIN, name=JOIN_NAME, last_joined=last))
        return out

    def _abandoned(self) -> List[Response]:
        """The failures of every noticed group the other ranks have sent whole, in
        whichever form (abandon.py)."""
        out = []
        for names, gone in settled(self._table, self._notices, self.size, self._joined):
            if self.names is not None:
                gone = {self.names[r]: why for r, why in gone.items()}
            for name in names:
                first = next(iter(self._table.pop(name).values()))
                del self._first_seen[name]
                out.append(abandoned_response(name, first, gone))
        self._notices = OrderedDict((n, None) for n in self._notices if n in self._table)
        return out

    def stalled(self, now: float, after: float) -> List[Tuple[str, List[int], List[int], float]]:
        """(name, ranks that submitted, ranks missing, seconds waiting) for old entries."""
        report = []
        for name, requests in self._table.items():
            waited = now - self._first_seen[name]
            if waited >= after:
                have = sorted(requests)
                missing = [r for r in range(self.size) if r not in requests and r not in self._joined]
                if self.names is not None:
                    have, missing = [self.names[r] for r in have], [self.names[r] for r in missing]
                report.append((name, have, missing, waited))
        return report
