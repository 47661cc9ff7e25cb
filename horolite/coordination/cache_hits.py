"""Requests found in the response cache, waiting for the cycle in which every rank has
them ready.

Such a request is not sent to rank 0: each cycle's control round carries a bit per
cache slot (control.py), and once every rank's bit is set the cached response runs.
Small ones also ride in the round itself (execution/carried.py). A request that
waits longer than `demote_after` goes to rank 0 after all, so that rank 0 sees it
and can report it if it stalls.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from ..core.messages import Response
from .tensor_queue import Entry

__all__ = ["CacheHits"]


class CacheHits:
    def __init__(self, cache, carrier, demote_after: float):
        self.cache, self.carrier, self.demote_after = cache, carrier, demote_after
        self.waiting: Dict[int, Entry] = {}  # cache slot -> entry, in submission order
        self.waited = 0  # cache hits that came here to wait (tests read it)
        # For the straggler record: when the newest of the last round's carried ones was
        # submitted, and the first one's name.
        self.newest_carried = 0.0
        self.carried_name = ""

    def hold(self, slot: int, entry: Entry) -> bool:
        """Wait for `slot` to be ready everywhere; False if another entry already does."""
        if slot in self.waiting:
            return False
        self.waiting[slot] = entry
        self.waited += 1
        return True

    def expired(self, now: float) -> List[Tuple[int, Entry]]:
        """The (slot, entry) pairs that waited too long, no longer waiting."""
        # Oldest first (insertion order is submission order): stop at the first young one.
        slots = []
        for slot, entry in self.waiting.items():
            if now - entry.taken <= self.demote_after:
                break
            slots.append(slot)
        return [(slot, self.waiting.pop(slot)) for slot in slots]

    def pop(self, slot: int) -> Optional[Entry]:
        return self.waiting.pop(slot, None)

    def drain(self) -> List[Entry]:
        """Every waiting entry, none left waiting."""
        entries = list(self.waiting.values())
        self.waiting.clear()
        return entries

    def post(self) -> Sequence[int]:
        """Put the small waiting ones in the coming control round; the slots posted."""
        return self.carrier.post(self.waiting) if self.carrier is not None else ()

    def ready(self, ready: List[int], invalid: List[int], carried: List[int], timeline,
              now: float) -> Tuple[List[Response], List[Entry], int]:
        """After the control round: the carried slots are reduced and completed here
        (before any negotiation round reuses the mailboxes that hold them); the other
        ready ones are returned as (responses, entries) for the executor, with the
        bytes reduced here."""
        if invalid and ready:
            dropped = set(invalid)
            ready = [slot for slot in ready if slot not in dropped]
            carried = [slot for slot in carried if slot not in dropped]
        reduced = 0
        self.newest_carried = 0.0
        if carried:
            finished = list(map(self.waiting.pop, carried))
            newest = 0.0  # for the straggler record (a loop: most rounds carry one)
            for entry in finished:
                since = entry.submitted or entry.taken
                if since > newest:
                    newest = since
            self.newest_carried = newest
            responses = self.cache.responses(carried)
            self.carried_name = responses[0].name
            reduced = self.carrier.run(responses, finished, carried, timeline)
            if len(carried) == len(ready):
                ready = []
            else:
                done = set(carried)
                ready = [slot for slot in ready if slot not in done]
        if not ready:
            return [], [], reduced
        # Per tensor, every step: whole-list operations, no Python step per slot unless
        # the timeline is on.
        responses = self.cache.responses(ready)
        entries = list(map(self.waiting.pop, ready))
        if timeline.enabled:
            for resp, entry in zip(responses, entries):
                entry.responded = now
                timeline.span(resp.name, "NEGOTIATE", entry.taken, now, {"cached": True})
        return responses, entries, reduced
