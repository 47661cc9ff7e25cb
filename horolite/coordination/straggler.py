"""The straggler record: which rank holds the job back, and by how much.

The measure needs no clock shared between hosts. Each rank notes, for every control
round that completes collectives (a fused batch counts once), how long it had been
ready with all of that round's work when the round said it was ready everywhere: its
*age*, a duration on its own clock. The rank with the smallest age submitted last; the
largest minus the smallest is how long the first-ready rank waited for it. Ages collect
in a small buffer on every rank (`RoundAges`) and reach the process set's rank 0 now and
then (straggler_round.py); `StragglerTable` there turns them into running totals per
rank, since init and over a sliding window, and says when one rank accounts for most of
the waiting. Pure logic, no MPI.
"""
from __future__ import annotations

import collections
import json
from typing import Optional, Sequence

import numpy as np

__all__ = ["RoundAges", "StragglerTable", "encode_report", "decode_report", "empty_report",
           "NAME_SHARE", "NAME_FRACTION"]

# A rank is named a straggler when it was last in more than this share of the rounds
# and caused more than this share of the waiting...
NAME_SHARE = 0.5
# ... and the others spent at least this fraction of the window's time waiting for it
# (a balanced job's scheduling noise and the control round's own skew, a few ms a
# step on a loaded machine, stay below it).
NAME_FRACTION = 0.10
# ... and, per round it was last in, made them wait at least this long (seconds), in
# at least MIN_ROUNDS rounds: scheduling noise is not a straggler.
MIN_WAIT = 0.001
MIN_ROUNDS = 10
# Per-round ages kept before they must travel (the same count on every rank).
CAPACITY = 4096


class RoundAges:
    """This rank's ages (seconds) for the rounds that completed collectives since the
    last exchange. NaN: this rank had no entry of its own in that round (joined)."""

    def __init__(self, capacity: int = CAPACITY):
        self._ages: list = []  # a list: appending to it is the cheapest note per round
        self._capacity = capacity

    @property
    def count(self) -> int:
        return len(self._ages)

    def note(self, age: float) -> bool:
        """Add one round's age; True when the buffer is full (every rank fills it at the
        same round, since every rank sees the same rounds complete)."""
        ages = self._ages
        ages.append(age)
        return len(ages) >= self._capacity

    def peek(self) -> bytes:
        """The buffered ages as bytes (clear() empties the buffer once they travelled)."""
        return np.array(self._ages, dtype=np.float32).tobytes()

    def clear(self) -> None:
        self._ages = []


class _Totals:
    """Per rank: rounds it was last in, seconds of waiting it caused; and rounds seen."""

    def __init__(self, size: int):
        self.last = np.zeros(size, dtype=np.int64)
        self.wait = np.zeros(size, dtype=np.float64)
        self.rounds = 0

    def add(self, other: "_Totals") -> None:
        self.last += other.last
        self.wait += other.wait
        self.rounds += other.rounds


class StragglerTable:
    """Rank 0's running totals. `ranks`: the job ranks of the set's ranks, `hosts` their
    hosts; `window`: seconds the windowed totals cover."""

    def __init__(self, ranks: Sequence[int], hosts: Sequence[str], window: float,
                 started: float):
        self.ranks = list(ranks)
        self.hosts = list(hosts)
        self.size = len(self.ranks)
        self.window = float(window)
        self.started = started
        self.total = _Totals(self.size)
        self._recent: "collections.deque" = collections.deque()  # (end time, _Totals)

    @staticmethod
    def decode_ages(payloads: Sequence[bytes], size: int) -> np.ndarray:
        """The gathered buffers as a (rounds, ranks) array; ValueError if their lengths
        differ (every rank must have seen the same rounds)."""
        arrays = [np.frombuffer(p, dtype=np.float32) for p in payloads]
        if len(arrays) != size or len({a.size for a in arrays}) > 1:
            raise ValueError("straggler record: ranks sent different numbers of rounds "
                             f"({[a.size for a in arrays]})")
        return np.stack(arrays, axis=1) if arrays else np.empty((0, size), np.float32)

    @staticmethod
    def lateness(ages: np.ndarray):
        """Per round: the rank that was last (-1 where under two ranks took part) and how
        long the first-ready rank waited for it (seconds)."""
        valid = ~np.isnan(ages)
        enough = valid.sum(axis=1) >= 2
        low = np.where(valid, ages, np.inf)
        high = np.where(valid, ages, -np.inf)
        last = np.where(enough, np.argmin(low, axis=1), -1)
        wait = np.where(enough, high.max(axis=1, initial=-np.inf)
                        - low.min(axis=1, initial=np.inf), 0.0)
        return last, np.maximum(wait, 0.0)

    def absorb(self, ages: np.ndarray, now: float) -> None:
        """Add a batch of rounds (from StragglerTable.decode_ages) seen up to `now`."""
        last, wait = self.lateness(ages)
        batch = _Totals(self.size)
        took_part = last >= 0
        batch.rounds = int(took_part.sum())
        np.add.at(batch.last, last[took_part], 1)
        np.add.at(batch.wait, last[took_part], wait[took_part].astype(np.float64))
        self.total.add(batch)
        self._recent.append((now, batch))
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - self.window:
            self._recent.popleft()

    def windowed(self, now: float) -> _Totals:
        self._trim(now)
        out = _Totals(self.size)
        for _, batch in self._recent:
            out.add(batch)
        return out

    def straggler(self, totals: _Totals, seconds: float) -> Optional[int]:
        """The set rank that accounts for most of the waiting in `totals` (over `seconds`
        of the job's time), or None."""
        spent = float(totals.wait.sum())
        if spent <= 0.0 or seconds <= 0.0:
            return None
        worst = int(np.argmax(totals.wait))
        caused, last = float(totals.wait[worst]), int(totals.last[worst])
        if caused > NAME_SHARE * spent and last > NAME_SHARE * totals.rounds \
                and caused >= NAME_FRACTION * seconds and last >= MIN_ROUNDS \
                and caused >= MIN_WAIT * last:
            return worst
        return None

    def where(self, set_rank: int) -> str:
        return f"rank {self.ranks[set_rank]} (host {self.hosts[set_rank]})"

    def report(self, now: float) -> dict:
        """What straggler_report() returns: per job rank, over the window and since init."""
        window = self.windowed(now)
        covered = min(self.window, now - self.started)
        since = now - self.started

        def part(t: _Totals, r: int) -> dict:
            last = int(t.last[r])
            wait = float(t.wait[r])
            return {"last": last, "wait_seconds": wait,
                    "mean_wait_seconds": wait / last if last else 0.0,
                    "last_share": last / t.rounds if t.rounds else 0.0,
                    "wait_share": wait / float(t.wait.sum()) if t.wait.sum() > 0 else 0.0}

        def named(t: _Totals, seconds: float) -> Optional[int]:
            s = self.straggler(t, seconds)
            return None if s is None else self.ranks[s]

        return {
            "window_seconds": self.window,
            "rounds": {"window": window.rounds, "total": self.total.rounds},
            "straggler": {"window": named(window, covered), "total": named(self.total, since)},
            "ranks": {self.ranks[r]: {"host": self.hosts[r], "window": part(window, r),
                                      "total": part(self.total, r)}
                      for r in range(self.size)},
        }

    def line(self, now: float) -> Optional[str]:
        """The log line when one rank accounts for most of the window's waiting."""
        window = self.windowed(now)
        covered = min(self.window, now - self.started)
        worst = self.straggler(window, covered)
        if worst is None:
            return None
        last = int(window.last[worst])
        return (f"{self.where(worst)} was last in {_percent(last, window.rounds)} of "
                f"collectives over the last {covered:.0f} s; the others waited "
                f"{1e3 * window.wait[worst] / max(last, 1):.0f} ms per collective for it")

    def summary(self, now: float, top: int = 3) -> Optional[str]:
        """The job's end, for horolite-run: the slowest ranks and their share of the
        waiting; None when no rank accounts for most of it."""
        t = self.total
        if self.straggler(t, now - self.started) is None:
            return None
        spent = float(t.wait.sum())
        order = [int(r) for r in np.argsort(-t.wait, kind="stable")[:top] if t.wait[r] > 0]
        parts = [f"{self.where(r)} {_percent(t.wait[r], spent)} of the waiting, last in "
                 f"{_percent(t.last[r], t.rounds)} of collectives, "
                 f"{1e3 * t.wait[r] / max(int(t.last[r]), 1):.0f} ms each" for r in order]
        return "slowest ranks: " + "; ".join(parts)


def encode_report(report: dict) -> bytes:
    """The report as rank 0 hands it to the others (JSON: numbers and strings only)."""
    return json.dumps(report, separators=(",", ":")).encode()


def decode_report(data: bytes) -> dict:
    report = json.loads(data.decode())
    report["ranks"] = {int(r): v for r, v in report["ranks"].items()}
    return report


def _percent(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.0f}%" if whole else "0%"


def empty_report(ranks: Sequence[int], hosts: Sequence[str], window: float) -> dict:
    """Before any round reached rank 0."""
    return StragglerTable(ranks, hosts, window, 0.0).report(0.0)

