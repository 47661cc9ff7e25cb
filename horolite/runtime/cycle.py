"""One cycle of the background thread: take new work, exchange the control vector,
negotiate what is not cached, run what was agreed. Mixed into Runtime (background.py),
whose state it reads and writes; the thread that runs it is Runtime._loop's, or a
waiting caller's on one host (turns.py).

Each cycle every rank contributes one small vector to a bitwise-OR allreduce: flag
bits, the complement of the response-cache slots it has ready (so the OR of
complements is the complement of "ready everywhere") and the cache slots it wants
invalidated. Only when some rank has uncached work, has joined, or rank 0 must speak
does the cycle also gather requests to rank 0 and broadcast its responses.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

from ..coordination.control import COORDINATOR, HAS_UNSENT, JOINED, SHUTDOWN, STRAGGLERS
from ..coordination.negotiation_round import negotiate
from ..coordination.response_cache import HIT, INVALID, MISS
from ..coordination.tensor_queue import Entry
from ..core.messages import JOIN_NAME, Kind
from ..errors import ControlMessageError, HorovodInternalError, StallError
from ..execution.lane import pipelines
from ..failure.channel import PeerFailure, launcher_marker

__all__ = ["Cycle"]

_log = logging.getLogger("horolite")

# Why rank 0 stops the job (the reason word travels with the response list).
_STOP_ERRORS = {"stall": StallError, "control": ControlMessageError}


class Cycle:
    """Mixed into Runtime: uses its queue, cache, hits, transport, executor, lane,
    coordinator, stall, stragglers, autotuner, control state and failure parts."""

    def _cycle(self) -> bool:
        """One negotiate-fuse-execute round; False when the runtime must stop."""
        now = time.monotonic()
        if self.lane is not None:
            self.lane.check()  # what the exchange lane met ends the job from here
        if self.links is not None:
            self.links.check()  # before anything makes MPI progress (failure/links.py)
        if self.transport.cross_host is not None:
            self.transport.cross_host.check()  # a TCP connection to a peer closed
        notice = self.failures.check(now) or self.failures.sent
        if notice is not None:
            raise PeerFailure(notice)
        if self.heartbeat is not None:
            self.heartbeat.tick(now)
        if self._mark_cycles:
            self.timeline.instant("CYCLE_START")
        lookup = self.cache.lookup if self.cache.capacity else None
        hits = self.hits
        for entry in self.queue.take_new():
            entry.taken = now
            req = entry.request
            if req.quorum and self.executor.quorum.answer(entry):
                continue  # decided without this rank: answered with that result
            if req.kind == Kind.JOIN:
                self._joined = True
                self._unsent.append(entry)
                continue
            status, slot = lookup(req) if lookup is not None else (MISS, -1)
            if status is not HIT or not hits.hold(slot, entry):
                if status is INVALID:
                    self._invalid.add(slot)
                self._unsent.append(entry)
        for slot, entry in hits.expired(now):
            self._invalid.add(slot)
            self._unsent.append(entry)

        flags = 0
        if self._unsent:
            flags |= HAS_UNSENT
        if self._shutdown_requested.is_set():
            flags |= SHUTDOWN
        if self._joined:
            flags |= JOINED
        stop = None
        if self.stall is not None:
            stall_message = self.stall.check(self.coordinator, now, self.rank)
            if stall_message:
                stop = ("stall", stall_message)
                flags |= COORDINATOR
        if self.stragglers.due(now):
            flags |= STRAGGLERS

        control = self._control
        if self.leader is not None and self.rank == 0:
            self._setting = self._set_setting()
        vec = control.encode(flags, self._setting if self.rank == 0 else None,
                             hits.waiting, self._invalid, hits.post())
        self._invalid.clear()
        # Nothing of this rank's rides on an idle cycle's exchange (which may wait for a
        # peer's next cycle for a whole step): it is polled slowly until work arrives.
        idle = (self.queue.wake if not flags and not self.pacing.waiting()
                and not self.executor.quorum.active(now) else None)
        self.transport.control_or(vec, control.received, idle, urgent=bool(flags))
        answered = time.monotonic()
        global_flags, fusion_threshold, self._cycle_seconds, ready_slots, invalid_slots, \
            carried_slots = control.decode()
        self.executor.set_fusion_threshold(fusion_threshold)

        if global_flags & SHUTDOWN:
            if self.lane is not None:
                self.lane.drain()  # what every rank agreed before runs to its end
            # Quorum results decided before the others left still answer this rank's
            # submissions, now and later (a straggler finishing its steps).
            self.queue.after_close = self._answer_late
            error = self._cause_behind(self._shutdown_error())
            failed = self._fail_pending(error)
            self.stragglers.finish(self.transport, self.timeline)
            first = getattr(error, "horolite_peer", None)
            if failed and first is not None:
                launcher_marker("stopped", rank=self.rank, by=first, text=error)
            return False

        for slot in invalid_slots:
            entry = hits.pop(slot)
            if entry is not None:
                self._unsent.append(entry)
            self.cache.erase(slot)
        responses, entries, reduced = hits.ready(ready_slots, invalid_slots, carried_slots,
                                                 self.timeline, now)

        if global_flags & JOINED:
            # A joined rank sets no cache bits: everything goes through rank 0 until all join.
            self._unsent.extend(hits.drain())

        agreed_stop = None
        # Every rank takes this branch or none: it depends only on reduced values.
        if global_flags & (HAS_UNSENT | JOINED | COORDINATOR) or invalid_slots:
            mine, self._unsent = [e.request for e in self._unsent], []
            negotiated, agreed_stop = negotiate(self.transport, self.coordinator, self.rank,
                                                mine, stop)
            done = time.monotonic()
            for resp in negotiated:
                entry = self.queue.get(resp.name) if resp.kind != Kind.JOIN else self._join_entry()
                if resp.kind == Kind.JOIN:
                    self._joined = False
                if entry is not None:
                    entry.responded = done
                    self.timeline.span(resp.name, "NEGOTIATE", entry.taken, done)
                    if self.cache.cacheable(resp):
                        evicted_slot = self.cache.put(entry.request, resp)
                        if evicted_slot is not None:
                            self._demote(evicted_slot)
                responses.append(resp)
                entries.append(entry)

        full = bool(responses or carried_slots) and self.stragglers.note(
            entries, hits.newest_carried, answered, self.timeline, responses, hits.carried_name)
        lane = self.lane
        if responses:
            if lane is not None and self.pipelined and pipelines(responses):
                lane.submit(responses, entries)  # this rank goes on to the next cycle
            else:
                if lane is not None:
                    lane.drain()  # everything runs in the agreed order
                reduced += self.executor.run(responses, entries)
        if lane is not None:
            reduced += lane.take_reduced()
        if full or global_flags & STRAGGLERS:
            self.stragglers.exchange(self.transport, self.timeline)
        if (responses or carried_slots) and self.autotuner is not None and \
                self.autotuner.observe(time.monotonic(), reduced):
            self._setting = self.autotuner.setting
        if agreed_stop:
            reason, message = agreed_stop
            _log.error("rank %d: %s", self.rank, message)
            if self.rank == 0:
                launcher_marker("stall" if reason == "stall" else "cause", rank=0, code=1,
                                text=message)
            self._doom(_STOP_ERRORS.get(reason, HorovodInternalError)(message))
            return False
        return True

    def _join_entry(self) -> Optional[Entry]:
        return self.queue.get(JOIN_NAME)

    def _demote(self, slot: int) -> None:
        entry = self.hits.pop(slot)
        if entry is not None:
            self._unsent.append(entry)
