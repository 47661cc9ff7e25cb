"""Chrome-trace timeline (open in Perfetto or chrome://tracing).

One row per tensor. Events are appended to a JSON array that is closed
only by ``close``: trace viewers accept an array left open (a process that
dies leaves a usable file), so nothing is ever rewritten.
Events collect in memory and reach the file once per background cycle
(``flush``) and at close, so recording costs one write per cycle, not per
event. ``read_events`` parses such a file (also one still being written).
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Dict, List, Optional

__all__ = ["Timeline", "NullTimeline", "SetTimeline", "open_timeline", "read_events"]


class NullTimeline:
    enabled = False

    def span(self, name: str, phase: str, start: float, end: float, args=None) -> None:
        pass

    def instant(self, label: str) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class Timeline(NullTimeline):
    enabled = True

    def __init__(self, path: str, rank: int):
        if rank > 0:
            root, ext = os.path.splitext(path)
            path = f"{root}.rank{rank}{ext or '.json'}"
        self.path = path
        self._rank = rank
        self._lock = threading.Lock()
        self._rows: Dict[str, int] = {}
        self._quoted: Dict[str, str] = {}  # phase -> its JSON string
        self._origin = time.monotonic()
        self._pending: List[str] = []
        self._separator = ""  # before the next event written: nothing for the first
        self._file = open(path, "w", encoding="utf-8")
        self._file.write("[\n")
        self._emit({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                    "args": {"name": f"rank {rank}"}})
        self.flush()

    def _us(self, t: float) -> float:
        return round((t - self._origin) * 1e6, 1)

    def _emit(self, event: dict) -> None:
        self._pending.append(json.dumps(event, separators=(",", ":")))

    def _row(self, name: str) -> int:
        row = self._rows.get(name)
        if row is None:
            row = self._rows[name] = len(self._rows) + 1
            self._emit({"name": "thread_name", "ph": "M", "pid": self._rank, "tid": row,
                        "args": {"name": name}})
        return row

    def span(self, name: str, phase: str, start: float, end: float, args=None) -> None:
        """A finished phase of tensor `name`, from monotonic times start to end."""
        with self._lock:
            ts, te = self._us(start), self._us(end)
            if args:
                self._emit({"name": phase, "ph": "X", "pid": self._rank, "tid": self._row(name),
                            "ts": ts, "dur": max(te - ts, 0.0), "args": args})
                return
            # The common event, formatted directly: json.dumps would be most of its cost.
            quoted = self._quoted.get(phase)
            if quoted is None:
                quoted = self._quoted[phase] = json.dumps(phase)
            self._pending.append(f'{{"name":{quoted},"ph":"X","pid":{self._rank},'
                                 f'"tid":{self._row(name)},"ts":{ts},"dur":{max(te - ts, 0.0)}}}')

    def instant(self, label: str) -> None:
        with self._lock:
            self._emit({"name": label, "ph": "i", "s": "p", "pid": self._rank, "tid": 0,
                        "ts": self._us(time.monotonic())})

    def flush(self) -> None:
        """Append what this cycle recorded; one write and one flush."""
        with self._lock:
            if self._file is None or not self._pending:
                return
            self._file.write(self._separator + ",\n".join(self._pending))
            self._separator = ",\n"
            self._file.flush()
            self._pending.clear()

    def close(self) -> None:
        self.flush()
        with self._lock:
            if self._file is not None:
                self._file.write("\n]\n")
                self._file.close()
                self._file = None
            self._pending.clear()


class SetTimeline(NullTimeline):
    """A process set's view of its process's one timeline, the global set's (which
    start_timeline/stop_timeline may swap at any time): rows named `<prefix><tensor>`."""

    def __init__(self, owner, prefix: str):
        self._owner = owner  # the global set's Runtime: its `timeline` is read at each event
        self._prefix = prefix

    @property
    def enabled(self) -> bool:
        return self._owner.timeline.enabled

    def span(self, name: str, phase: str, start: float, end: float, args=None) -> None:
        self._owner.timeline.span(self._prefix + name, phase, start, end, args)

    def instant(self, label: str) -> None:
        self._owner.timeline.instant(self._prefix + label)

    def flush(self) -> None:
        self._owner.timeline.flush()

    def close(self) -> None:
        pass  # the owner's to close


def open_timeline(path: Optional[str], rank: int) -> NullTimeline:
    return Timeline(path, rank) if path else NullTimeline()


def read_events(path: str) -> list:
    """The events of a timeline file, whether its array is closed or left open."""
    with open(path, encoding="utf-8") as f:
        text = f.read().rstrip()
    if not text.endswith("]"):
        text += "]"
    return json.loads(text)
