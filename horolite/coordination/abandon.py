"""Abandon notices: a rank says it will never send a tensor, and every rank's request
for it fails naming that rank (a step that failed there after some of its buckets had
left: api/buckets.py).

A notice for `N` stands for the group `N` whatever form the other ranks sent it in: one
request `N` (a packed group, or one tensor), or the requests `N.0` .. `N.<m-1>` of a
grouped allreduce that could not be packed (mixed dtypes, Adasum, device arrays:
api/collectives.py), each of which says it is one of m (`Request.members`). The rank
that gives up cannot know that form: it may never have built the group in this process
(its first step failed). So rank 0 reads it from what the others sent: the notice is
answered once every other rank has sent the whole group, one way or the other, and all
of it fails in that same response list. The giving-up rank sends `N` again only after its
notice is answered (BucketRuns waits for it), so its next run never pairs with the
others' failed one. (Notices for every name either form could have would leave those
of the form nobody sent unanswered, and that rank waiting on them.) Members that wait on
response-cache bits reach rank 0 once they are demoted (runtime/background.py), within
about a second.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Tuple

from ..core.messages import Request

__all__ = ["settled"]


def _members(table: Dict[str, Dict[int, Request]], base: str) -> List[str]:
    """The names in `table` of group `base`'s separate members, `<base>.<k>`."""
    prefix = base + "."
    return [name for name, entry in table.items()
            if name.startswith(prefix) and name[len(prefix):].isdigit()
            and any(q.members for q in entry.values())]


def _sent_whole(rank: int, base: str, table, members: List[str]) -> bool:
    """Whether `rank` sent group `base` whole: as `base`, or every member it says it has."""
    if rank in table[base]:
        return True
    counts = [table[name][rank].members for name in members if rank in table[name]]
    if not counts:
        return False
    entries = (table.get(f"{base}.{k}") for k in range(counts[0]))
    return all(entry is not None and rank in entry for entry in entries)


def settled(table: Dict[str, Dict[int, Request]], notices: Iterable[str], size: int,
            joined: Iterable[int]) -> List[Tuple[List[str], Dict[int, str]]]:
    """For each noticed group that every other rank (not joined) has sent whole: the
    names that fail (its members, then the notice's own) and the ranks that gave up
    (rank -> why)."""
    out = []
    joined = set(joined)
    for base in notices:
        entry = table.get(base)
        gone = {r: q.abandoned for r, q in entry.items() if q.abandoned} if entry else {}
        if not gone:
            continue
        members = _members(table, base)
        if all(_sent_whole(r, base, table, members) for r in range(size)
               if r not in gone and r not in joined):
            out.append((members + [base], gone))
    return out
