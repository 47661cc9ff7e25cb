"""Response cache: tensors seen before skip the gather/broadcast.

Every rank holds the same cache because every rank applies the same responses
in the same order; a slot number therefore names the same tensor everywhere,
and one bitwise allreduce of "slots I have ready" finds what is ready on all.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

from .messages import Kind, Request, Response

__all__ = ["ResponseCache", "HIT", "MISS", "INVALID"]

HIT, MISS, INVALID = "hit", "miss", "invalid"

_CACHEABLE = {Kind.ALLREDUCE, Kind.ALLGATHER, Kind.BROADCAST, Kind.ALLTOALL, Kind.REDUCESCATTER}


class ResponseCache:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._slots: List[Optional[Tuple[tuple, Response]]] = [None] * capacity
        self._by_name: Dict[str, Tuple[int, tuple]] = {}  # name -> (slot, request signature)
        self._recency: "OrderedDict[int, None]" = OrderedDict()  # least recent first

    def __len__(self) -> int:
        return len(self._by_name)

    def lookup(self, request: Request) -> Tuple[str, int]:
        """(HIT, slot), (MISS, -1), or (INVALID, slot) when the name is cached with other parameters."""
        found = self._by_name.get(request.name)
        if found is None:
            return MISS, -1
        slot, signature = found
        return (HIT, slot) if signature == request.signature() else (INVALID, slot)

    def response(self, slot: int) -> Response:
        return self._slots[slot][1]

    def cacheable(self, response: Response) -> bool:
        return (self.capacity > 0 and response.error is None and response.kind in _CACHEABLE
                and not response.joined)

    def put(self, request: Request, response: Response) -> Optional[int]:
        """Store a response under this rank's request; returns the slot evicted, if any."""
        evicted = None
        found = self._by_name.get(request.name)
        slot = found[0] if found is not None else None
        if slot is None:
            if len(self._by_name) < self.capacity:
                slot = self._slots.index(None)
            else:
                slot = next(iter(self._recency))
                evicted = slot
                self.erase(slot)
        signature = request.signature()
        self._slots[slot] = (signature, response)
        self._by_name[request.name] = (slot, signature)
        self._recency[slot] = None
        self._recency.move_to_end(slot)
        return evicted

    def touch(self, slot: int) -> None:
        self._recency.move_to_end(slot)

    def erase(self, slot: int) -> None:
        entry = self._slots[slot]
        if entry is None:
            return
        del self._by_name[entry[1].name]
        self._slots[slot] = None
        self._recency.pop(slot, None)
