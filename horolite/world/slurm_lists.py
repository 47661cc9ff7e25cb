"""Slurm's compressed lists: hostlists ("node[01-04,07],gpu2") and task counts ("2(x3),1").

Slurm writes the nodes of a job and the tasks on each in these forms (SLURM_JOB_NODELIST,
SLURM_TASKS_PER_NODE); a rank started by srun without MPI reads its rendezvous host and
its local size from them, without calling `scontrol show hostnames`, which may not be on
the compute node's PATH.
"""
from __future__ import annotations

import re
from typing import Iterator, List

__all__ = ["expand_hostlist", "hosts", "tasks_per_node"]

_COUNT = re.compile(r"^\s*(\d+)\s*(?:\(\s*x\s*(\d+)\s*\))?\s*$")


def tasks_per_node(text: str) -> List[int]:
    """Slurm's "2(x3),1" as [2, 2, 2, 1]."""
    out: List[int] = []
    for item in text.split(","):
        m = _COUNT.match(item)
        if not m:
            raise ValueError(f"{item.strip()!r} is not a count of tasks like 2 or 2(x3)")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


def _split_top(text: str) -> Iterator[str]:
    depth, start = 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "[") - (ch == "]")
        if depth < 0:
            raise ValueError(f"unbalanced ']' in {text!r}")
        if ch == "," and depth == 0:
            yield text[start:i]
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced '[' in {text!r}")
    yield text[start:]


def _expand_one(name: str) -> Iterator[str]:
    open_at = name.find("[")
    if open_at < 0:
        yield name
        return
    close_at = name.index("]", open_at)
    head, body, tail = name[:open_at], name[open_at + 1:close_at], name[close_at + 1:]
    for part in body.split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"{part!r} in {name!r} is not a number or a range like 01-04")
        first, last = int(low), int(high) if dash else int(low)
        if last < first:
            raise ValueError(f"range {part!r} in {name!r} runs backwards")
        for n in range(first, last + 1):
            for rest in _expand_one(tail):
                yield f"{head}{n:0{len(low)}d}{rest}"


def hosts(text: str) -> Iterator[str]:
    """The names of a hostlist, one at a time (the first is enough for a rendezvous)."""
    for item in _split_top(text.strip()):
        if item.strip():
            yield from _expand_one(item.strip())


def expand_hostlist(text: str) -> List[str]:
    """Slurm's "node[01-04,07],gpu2" as ["node01", ..., "node04", "node07", "gpu2"]."""
    return list(hosts(text))
