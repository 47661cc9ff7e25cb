"""Chrome-trace timeline (open in Perfetto or chrome://tracing).

One row per tensor. The file is valid JSON after every write: each event is
written over the closing bracket, which is written again after it, so a
process that dies leaves a file that still parses.
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Dict, Optional

__all__ = ["Timeline", "NullTimeline"]


class NullTimeline:
    enabled = False

    def span(self, name: str, phase: str, start: float, end: float, args=None) -> None:
        pass

    def instant(self, label: str) -> None:
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
        self._origin = time.monotonic()
        self._file = open(path, "wb")
        self._file.write(b"[\n]")
        self._file.flush()
        self._end = 2  # offset of the closing bracket
        self._first = True
        self._emit({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                    "args": {"name": f"rank {rank}"}})

    def _us(self, t: float) -> float:
        return round((t - self._origin) * 1e6, 1)

    def _emit(self, event: dict) -> None:
        text = json.dumps(event, separators=(",", ":"))
        if self._file is None:
            return
        data = (("" if self._first else ",\n") + text + "\n").encode()
        self._file.seek(self._end)
        self._file.write(data + b"]")
        self._file.flush()
        self._end += len(data)
        self._first = False

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
            event = {"name": phase, "ph": "X", "pid": self._rank, "tid": self._row(name),
                     "ts": self._us(start), "dur": max(self._us(end) - self._us(start), 0.0)}
            if args:
                event["args"] = args
            self._emit(event)

    def instant(self, label: str) -> None:
        with self._lock:
            self._emit({"name": label, "ph": "i", "s": "p", "pid": self._rank, "tid": 0,
                        "ts": self._us(time.monotonic())})

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def open_timeline(path: Optional[str], rank: int) -> NullTimeline:
    return Timeline(path, rank) if path else NullTimeline()
