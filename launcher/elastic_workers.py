"""The processes of an elastic job without MPI, and the plans that place them in a world.

A worker is one process started by launcher/elastic_gloo.py (its rank wrapper, or the
ssh to it) under a name it keeps for the job's life ("w3"), whatever its rank in each
generation. Its output is relayed line by line; the runtime's and the wrapper's
marker lines are handed to the driver instead.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import threading
from typing import Dict, List, Optional

from . import gloo
from .markers import marker_line, parse_marker

__all__ = ["Worker", "plan_for", "free_slot"]


def plan_for(generation: int, workers: List[str], hosts: Dict[str, str],
             slots: Optional[Dict[str, int]] = None) -> dict:
    """Generation `generation`'s world: `workers` in rank order. A worker's local rank is
    its slot on its host (`slots`: kept for its life, so the GPU it pinned stays its own),
    or, without `slots`, its place among this plan's workers there (gloo.layout's way);
    a host's local size covers its highest slot, and cross ranks count the ranks with
    the same local rank, in rank order."""
    names = [hosts[w] for w in workers]
    local = [slots[w] for w in workers] if slots else \
        [s.local_rank for s in gloo.slots_for(names)]
    size: Dict[str, int] = {}
    for name, lr in zip(names, local):
        size[name] = max(size.get(name, 0), lr + 1, names.count(name))
    same_local: Dict[int, List[int]] = {}
    for rank, lr in enumerate(local):
        same_local.setdefault(lr, []).append(rank)
    kept = {"slot": True} if slots else {}  # (the ranks then take their local rank as kept)
    return {"generation": generation, "size": len(workers),
            "ranks": [dict(dataclasses.asdict(gloo.RankSlot(
                rank, name, lr, size[name], same_local[lr].index(rank), len(same_local[lr]))),
                worker=w, **kept) for rank, (w, name, lr) in enumerate(zip(workers, names, local))]}


def free_slot(taken: List[int]) -> int:
    """The lowest local rank of a host that no worker there holds."""
    return next(k for k in range(len(taken) + 1) if k not in taken)


class Worker:
    """One started process and its output relays."""

    def __init__(self, name: str, spec: dict, cwd: str, on_marker):
        self.name, self.host, self.rank = name, spec["host"], spec["rank"]
        self.remote = spec["remote"]
        self.joining = False  # started after generation 0, to join at a commit
        self.slot: Optional[int] = None  # its local rank on its host, for its life
        self.evicted: Optional[str] = None  # why, once evicted
        env = None if self.remote else dict(os.environ, **spec["env"])
        self.proc = subprocess.Popen(spec["argv"], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE,
                                     stdin=subprocess.PIPE if self.remote else subprocess.DEVNULL)
        self._relays = [threading.Thread(target=self._relay, args=(pipe, out, on_marker),
                                         daemon=True, name=f"horolite-run-relay-{name}")
                        for pipe, out in ((self.proc.stdout, 1), (self.proc.stderr, 2))]
        for relay in self._relays:
            relay.start()
        if self.remote:
            self.tell(json.dumps({"env": spec["env"], "cwd": cwd}))

    def tell(self, line: str) -> None:
        """A line down ssh's stdin to the remote wrapper (its environment, a signal)."""
        try:
            self.proc.stdin.write(line.encode() + b"\n")
            self.proc.stdin.flush()
        except (OSError, ValueError):
            pass

    def _relay(self, pipe, out: int, on_marker) -> None:
        for line in iter(pipe.readline, b""):
            marker = marker_line(line)
            if marker is not None:
                parsed = parse_marker(marker.decode("utf-8", "replace"))
                if parsed is not None:
                    on_marker(self, *parsed)
                continue
            try:
                os.write(out, line)
            except OSError:
                pass

    def join_relays(self, seconds: float) -> None:
        for relay in self._relays:
            relay.join(seconds)

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """The wrapper forwards it to the command's group, then SIGKILLs what is left."""
        if self.proc.poll() is not None:
            return
        if self.remote:
            self.tell(signal.Signals(signum).name)
        else:
            try:
                os.kill(self.proc.pid, signum)
            except ProcessLookupError:
                pass

    def failed(self) -> bool:
        return self.proc.poll() is not None and self.proc.returncode != 0

    def how(self) -> str:
        code = self.proc.returncode
        signum = -code if code is not None and code < 0 else \
            code - 128 if code is not None and 128 < code < 128 + signal.NSIG else 0
        if signum:
            return f"was killed by signal {signum} ({signal.Signals(signum).name})"
        return f"exited with code {code}"
