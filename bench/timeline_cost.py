"""Cost of one timeline event: appended and flushed once per cycle, against
rewriting the closing bracket and flushing after every event.

    python bench/timeline_cost.py [--events 20000] [--per-cycle 1 4 16 64] [--repeat 5]

The timeline records a few events per tensor (NEGOTIATE, QUEUE, the
collective...) on the background thread, so its cost per event is time that
thread does not spend on collectives. For each number of events per
background cycle, this times `Timeline.span` plus one `flush` per cycle
(horolite's timeline) and the previous way of writing the file (seek to the
closing bracket, write the event and the bracket, flush: kept here as the
peer), into a file in --dir, and prints microseconds per event and the ratio,
best of --repeat runs. Single process, no MPI.
"""
import argparse
import json
import os
import sys
import tempfile
import threading
import time

try:
    import horolite  # noqa: F401  (installed)
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from horolite.core.timeline import Timeline, read_events


class RewriteEachEvent:
    """The peer: valid JSON after every event, by writing over the closing bracket."""

    def __init__(self, path):
        self._lock = threading.Lock()
        self._rows = {}
        self._origin = time.monotonic()
        self._file = open(path, "wb")
        self._file.write(b"[\n]")
        self._file.flush()
        self._end, self._first = 2, True

    def _emit(self, event):
        data = (("" if self._first else ",\n") + json.dumps(event, separators=(",", ":")) + "\n").encode()
        self._file.seek(self._end)
        self._file.write(data + b"]")
        self._file.flush()
        self._end += len(data)
        self._first = False

    def span(self, name, phase, start, end, args=None):
        with self._lock:
            row = self._rows.get(name)
            if row is None:
                row = self._rows[name] = len(self._rows) + 1
                self._emit({"name": "thread_name", "ph": "M", "pid": 0, "tid": row, "args": {"name": name}})
            self._emit({"name": phase, "ph": "X", "pid": 0, "tid": row,
                        "ts": round((start - self._origin) * 1e6, 1),
                        "dur": round((end - start) * 1e6, 1)})

    def flush(self):
        pass

    def close(self):
        self._file.close()


def time_per_event(make, path, events, per_cycle):
    timeline = make(path)
    names = [f"grad.{i}" for i in range(64)]
    t0 = time.perf_counter()
    for i in range(events):
        now = time.monotonic()
        timeline.span(names[i % len(names)], "ALLREDUCE", now, now)
        if (i + 1) % per_cycle == 0:
            timeline.flush()
    timeline.close()
    seconds = time.perf_counter() - t0
    assert len(read_events(path)) >= events  # both files parse and hold every event
    return seconds / events


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--events", type=int, default=20000)
    p.add_argument("--per-cycle", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the files are written")
    args = p.parse_args(argv)
    path = os.path.join(args.dir, f"horolite-timeline-cost-{os.getpid()}.json")
    print(f"{args.events} events into {args.dir}, best of {args.repeat}\n")
    print("| events per cycle | appended, flushed per cycle (us/event) | rewritten per event (us/event) | ratio |")
    print("|---:|---:|---:|---:|")
    try:
        for per_cycle in args.per_cycle:
            new = min(time_per_event(lambda p: Timeline(p, 0), path, args.events, per_cycle)
                      for _ in range(args.repeat))
            old = min(time_per_event(RewriteEachEvent, path, args.events, per_cycle)
                      for _ in range(args.repeat))
            print(f"| {per_cycle} | {new * 1e6:.2f} | {old * 1e6:.2f} | {old / new:.1f}x |")
    finally:
        if os.path.exists(path):
            os.remove(path)


if __name__ == "__main__":
    main()
