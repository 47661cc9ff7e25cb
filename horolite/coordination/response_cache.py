"""Response cache: tensors seen before skip the gather/broadcast.

Every rank holds the same cache because every rank applies the same responses
in the same order; a slot number therefore names the same tensor everywhere,
and one bitwise allreduce of "slots I have ready" finds what is ready on all.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np

from ..core.messages import Kind, Request, Response

__all__ = ["ResponseCache", "HIT", "MISS", "INVALID"]

HIT, MISS, INVALID = "hit", "miss", "invalid"

_CACHEABLE = {Kind.ALLREDUCE, Kind.ALLGATHER, Kind.BROADCAST, Kind.ALLTOALL, Kind.REDUCESCATTER}


class ResponseCache:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._responses: List[Optional[Response]] = [None] * capacity
        self._by_name: Dict[str, Tuple[int, tuple]] = {}  # name -> (slot, request signature)
        # When each slot was last put or used (-1: free). A cycle touches hundreds of
        # slots at once, so recency is one NumPy store per cycle; eviction (rare)
        # takes the least recent, the lowest slot on a tie, the same on every rank.
        self._last_used = np.full(capacity, -1, dtype=np.int64)
        self._clock = 0
        self.evictions = 0  # slots given to another tensor when full (tests read it)

    def __len__(self) -> int:
        return len(self._by_name)

    def lookup(self, request: Request) -> Tuple[str, int]:
        """(HIT, slot), (MISS, -1), or (INVALID, slot) when the name is cached with other parameters."""
        found = self._by_name.get(request.name)
        if found is None:
            return MISS, -1
        slot, signature = found
        return (HIT, slot) if signature == request.signature() else (INVALID, slot)

    def responses(self, slots: List[int]) -> List[Response]:
        """response() of each slot, and all of them marked used now."""
        self.touch(slots)
        return list(map(self._responses.__getitem__, slots))

    def cacheable(self, response: Response) -> bool:
        return (self.capacity > 0 and response.error is None and response.kind in _CACHEABLE
                and not response.joined and not response.contributors)

    def put(self, request: Request, response: Response) -> Optional[int]:
        """Store a response under this rank's request; returns the slot evicted, if any."""
        evicted = None
        found = self._by_name.get(request.name)
        slot = found[0] if found is not None else None
        if slot is None:
            if len(self._by_name) < self.capacity:
                slot = self._responses.index(None)
            else:
                slot = int(np.argmin(self._last_used))
                evicted = slot
                self.evictions += 1
                self.erase(slot)
        signature = request.signature()
        self._responses[slot] = response
        self._by_name[request.name] = (slot, signature)
        self.touch([slot])
        return evicted

    def touch(self, slots: List[int]) -> None:
        self._clock += 1
        self._last_used[slots] = self._clock

    def erase(self, slot: int) -> None:
        response = self._responses[slot]
        if response is None:
            return
        del self._by_name[response.name]
        self._responses[slot] = None
        self._last_used[slot] = -1
