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
import struct
from typing import Optional, Sequence, Tuple

import numpy as np

__all__ = ["RoundAges", "StragglerTable", "Report", "empty_report", "NAME_SHARE",
           "NAME_FRACTION"]

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
        if batch.rounds:  # (an exchange with no rounds, to age the window out, adds none)
            self._recent.append((now, batch))
        self._trim(now)

    def stale(self, now: float) -> bool:
        """Whether the window holds rounds older than it: an exchange would drop them,
        though no collective completes (straggler_round.py asks for one)."""
        return bool(self._recent) and self._recent[0][0] < now - self.window

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
        return self.compact(now).as_dict()

    def compact(self, now: float) -> "Report":
        """The report as arrays: what travels to the other ranks."""
        window = self.windowed(now)
        covered = min(self.window, now - self.started)

        def named(t: _Totals, seconds: float) -> Optional[int]:
            s = self.straggler(t, seconds)
            return None if s is None else self.ranks[s]

        return Report(self.window, (window.rounds, self.total.rounds),
                      (named(window, covered), named(self.total, now - self.started)),
                      np.stack([window.last, self.total.last]),
                      np.stack([window.wait, self.total.wait]), self.ranks, self.hosts)

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


# window seconds, rounds (window, total), straggler (window, total; -1: none), ranks
_HEADER = struct.Struct("<dqqqqq")
_KEYS = ("last", "wait_seconds", "mean_wait_seconds", "last_share", "wait_share")


class Report:
    """The report kept as per-rank arrays (row 0 the window, row 1 since init) and made
    a dict only when straggler_report() reads it: at 1024 ranks the dict took ~5 ms to
    build, ~3 ms to pass through JSON and ~4 ms to deepcopy, and ~240 KB to broadcast;
    this travels in 32 bytes a rank (docs/benchmarks.md). Never changed once made, so
    the background thread can swap in the next while a caller reads this one."""

    __slots__ = ("window_seconds", "rounds", "straggler", "last", "wait", "ranks", "hosts")

    def __init__(self, window_seconds: float, rounds: Tuple[int, int],
                 straggler: Tuple[Optional[int], Optional[int]], last: np.ndarray,
                 wait: np.ndarray, ranks: Sequence[int], hosts: Sequence[str]):
        self.window_seconds = float(window_seconds)
        self.rounds, self.straggler = rounds, straggler
        self.last = last.astype(np.int64, copy=False)  # (2, ranks)
        self.wait = wait.astype(np.float64, copy=False)  # (2, ranks)
        self.ranks, self.hosts = ranks, hosts

    def encode(self) -> bytes:
        named = [-1 if s is None else s for s in self.straggler]
        return (_HEADER.pack(self.window_seconds, *self.rounds, *named, len(self.ranks))
                + self.last.tobytes() + self.wait.tobytes())

    @classmethod
    def decode(cls, data: bytes, ranks: Sequence[int], hosts: Sequence[str]) -> "Report":
        window, r_window, r_total, s_window, s_total, size = _HEADER.unpack_from(data)
        if size != len(ranks):
            raise ValueError(f"straggler report of {size} ranks, expected {len(ranks)}")
        at = _HEADER.size
        last = np.frombuffer(data, np.int64, 2 * size, at).reshape(2, size)
        wait = np.frombuffer(data, np.float64, 2 * size, at + last.nbytes).reshape(2, size)
        return cls(window, (r_window, r_total), (None if s_window < 0 else s_window,
                                                 None if s_total < 0 else s_total),
                   last, wait, ranks, hosts)

    def as_dict(self) -> dict:
        """straggler_report()'s dict, a new one each call (numbers and strings only)."""
        parts = []
        for row, rounds in enumerate(self.rounds):
            last, wait = self.last[row], self.wait[row]
            spent = float(wait.sum())
            mean = np.divide(wait, last, out=np.zeros_like(wait), where=last > 0)
            last_share = last / rounds if rounds else np.zeros_like(wait)
            wait_share = wait / spent if spent > 0 else np.zeros_like(wait)
            parts.append(zip(last.tolist(), wait.tolist(), mean.tolist(), last_share.tolist(),
                             wait_share.tolist()))
        return {
            "window_seconds": self.window_seconds,
            "rounds": {"window": self.rounds[0], "total": self.rounds[1]},
            "straggler": {"window": self.straggler[0], "total": self.straggler[1]},
            "ranks": {r: {"host": h, "window": dict(zip(_KEYS, w)), "total": dict(zip(_KEYS, t))}
                      for r, h, w, t in zip(self.ranks, self.hosts, *parts)},
        }


def _percent(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.0f}%" if whole else "0%"


def empty_report(ranks: Sequence[int], hosts: Sequence[str], window: float) -> Report:
    """Before any round reached rank 0."""
    return StragglerTable(ranks, hosts, window, 0.0).compact(0.0)

