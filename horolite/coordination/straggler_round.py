"""The straggler record's place in the cycle: note each completing round's age, and now
and then bring every rank's ages to rank 0 and its report back (straggler.py).

Nothing rides on the rounds themselves. Every rank notes the same rounds, so the buffers
fill together and every rank knows, with no message, when they must travel; otherwise
rank 0 asks for them (a flag bit of the control vector) about once a second while there
is anything to send, or while its window holds rounds older than the window (so a quiet
stretch ages the report out on every rank alike). Then one gather of float32 ages (4
bytes a round and rank) to rank 0 and one broadcast of the report (32 bytes a rank):
two messages a second at most, none per collective. Joins and barriers are not noted:
waiting in them is what they are for.
"""
from __future__ import annotations

import logging
import math
import time
from typing import List, Optional, Sequence, Tuple

from .straggler import Report, RoundAges, StragglerTable, empty_report
from ..core.messages import Kind
from ..failure.channel import launcher_marker

__all__ = ["StragglerRound", "EXCHANGE_SECONDS", "DEFAULT_WINDOW"]

_log = logging.getLogger("horolite.coordination.straggler")

_JOIN, _BARRIER = Kind.JOIN, Kind.BARRIER

# How often rank 0 asks for the ranks' ages while rounds complete (at most).
EXCHANGE_SECONDS = 1.0
# The window straggler_report() covers when the log line is off (report seconds 0).
DEFAULT_WINDOW = 60.0


class StragglerRound:
    """One per runtime (process set). `ranks`/`hosts`: the set's job ranks and their
    hosts; `report_seconds`: the log line's period and the window (0: no log line)."""

    def __init__(self, rank: int, ranks: Sequence[int], hosts: Sequence[str],
                 report_seconds: float, label: str = ""):
        self.rank = rank
        self.ranks = list(ranks)
        self.hosts = list(hosts)
        self.label = label  # "process set 1: " or ""
        self.report_seconds = float(report_seconds)
        window = self.report_seconds or DEFAULT_WINDOW
        self._every = min(EXCHANGE_SECONDS, window / 4)
        self.ages = RoundAges()
        # False: nothing is noted (bench/straggler_ab.py compares; set on every rank at
        # once, between collectives, or the ranks' notes would not line up).
        self.enabled = True
        self.exchanges = 0  # how many, and their seconds on this rank: the record's cost
        self.exchange_seconds = 0.0
        now = time.monotonic()
        self.table = StragglerTable(ranks, hosts, window, now) if rank == 0 else None
        self.report = empty_report(ranks, hosts, window)
        self._sent = now  # last exchange
        self._logged = -math.inf
        self._rounds: List[Tuple[int, float, str]] = []  # rank 0 with a timeline: (index, done, name)

    def note(self, entries, newest_carried: float, done: float, timeline, responses,
             carried_name: str = "") -> bool:
        """A round completed collectives (`responses`, and any carried in the round, the
        first named `carried_name`): note how long this rank had been ready with all of
        them (NaN when none was its own). Joins and barriers are left out (every rank
        leaves out the same). True when the buffer must travel now."""
        if not self.enabled:
            return False
        newest = newest_carried
        counted = newest_carried > 0.0  # carried: every rank had its entry in the round
        name = carried_name
        for resp, entry in zip(responses, entries):
            kind = resp.kind
            if kind is _JOIN or kind is _BARRIER:
                continue
            if not counted:
                counted, name = True, resp.name
            if entry is not None:
                since = entry.submitted or entry.taken  # taken: submitted by native code
                if since > newest:
                    newest = since
        if not counted:
            return False
        if self.table is not None and timeline.enabled:
            self._rounds.append((self.ages.count, done, name))
        return self.ages.note(done - newest if newest > 0.0 else math.nan)

    def due(self, now: float) -> bool:
        """Rank 0: whether to ask for the ranks' ages in this cycle's control round: new
        rounds to count, or old ones the window must drop."""
        return (self.table is not None and now - self._sent >= self._every
                and (self.ages.count > 0 or self.table.stale(now)))

    def exchange(self, transport, timeline, now: Optional[float] = None) -> None:
        """Every rank at once: the ages to rank 0, its report back to all."""
        start = time.monotonic()
        now = start if now is None else now
        self._sent = now
        gathered = transport.gather_bytes(self.ages.peek())
        if self.table is not None:
            try:
                ages = StragglerTable.decode_ages(gathered, len(self.ranks))
            except ValueError as e:  # notes that do not line up: drop them, keep training
                _log.error("rank 0: %s%s; those rounds are left out", self.label, e)
                ages = None
            if ages is not None:
                self.table.absorb(ages, now)
                if self._rounds:
                    self._draw(ages, timeline)
            self._rounds.clear()
            self._maybe_log(now)
            self.report = self.table.compact(now)
            transport.bcast_bytes(self.report.encode())
        else:
            self.report = Report.decode(transport.bcast_bytes(b""), self.ranks, self.hosts)
        self.ages.clear()  # only now: a reader that sees it empty sees the new report
        self.exchanges += 1
        self.exchange_seconds += time.monotonic() - start

    def finish(self, transport, timeline) -> None:
        """At the agreed shutdown: the last ages, and the job's summary for horolite-run."""
        if self.ages.count:
            self.exchange(transport, timeline)
        if self.table is None:
            return
        summary = self.table.summary(time.monotonic())
        if summary is not None:
            _log.info("rank 0: %s%s", self.label, summary)
            if not self.label:  # the job's (not a process set's) for horolite-run
                launcher_marker("straggler", when="job", text=summary)

    def _maybe_log(self, now: float) -> None:
        if not self.report_seconds or now - self._logged < self.report_seconds:
            return
        line = self.table.line(now)
        if line is not None:
            self._logged = now
            _log.warning("rank 0: %s%s", self.label, line)
            if not self.label:  # the job's, for horolite-run's elastic driver
                launcher_marker("straggler", when="window", text=line)

    def _draw(self, ages, timeline) -> None:
        """Timeline rows 'submitted: rank r': from when each rank was ready (on rank 0's
        clock: the round's end less the rank's age) to the round's end."""
        for index, done, name in self._rounds:
            row = ages[index]
            first = max((a for a in row.tolist() if not math.isnan(a)), default=0.0)
            for r, age in enumerate(row.tolist()):
                if not math.isnan(age):
                    timeline.span(f"submitted: rank {self.ranks[r]}", name, done - age, done,
                                  {"after_first_ms": round(1e3 * (first - age), 3)})
