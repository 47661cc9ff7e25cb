"""Whom the ranks of an elastic job without MPI name as lost, and whom the launcher evicts.

A rank whose step failed, or whose world did not form within --gloo-timeout-seconds,
puts ``blame.<generation>.<its worker>`` at the rendezvous: the ranks (of that
generation's plan) it lost or waited for in vain (horolite/world/generations.py). The
driver (elastic_gloo.py) reads them here:

- a blame stands while both workers are members and neither has entered a newer world
  since (then the blamed one was alive after, or the blamer moved on); blames of every
  generation count, so a rank that hangs after a newer plan is out is still named;
- a blamed worker that itself blamed another in the same generation left that world on
  purpose (the others saw its connections close): it is not lost;
- two workers that blame each other are waiting on each other for a third that named
  nobody (stopped while the world formed): only that one goes; where there is no such
  third (a partition whose halves both reach the launcher) they are told apart by
  majority: the worker the most others named goes, ties going against the newest, so
  the side with more ranks, or with the oldest rank (the state's source for the others),
  goes on.
"""
from __future__ import annotations

import collections
from typing import Collection, Dict, List, Mapping, NamedTuple, Sequence, Tuple

__all__ = ["Blame", "PARTITION", "standing", "to_evict"]

PARTITION = "(a partition)"  # in the reason of a worker evicted as a partition's loser


class Blame(NamedTuple):
    generation: int
    blamer: str  # worker names
    blamed: str  # ("": the blamer named nobody, it only left that world)


def standing(items: Mapping[str, bytes], plans: Mapping[int, Sequence[str]],
             members: Sequence[str], entered: Mapping[str, int]) -> List[Blame]:
    """The blames among the rendezvous' `items` that still stand. `plans`: each
    generation's workers in rank order; `members`: the current plan's; `entered`: the
    newest generation each worker entered."""
    found = []
    for key, value in items.items():
        parts = key.split(".", 2)
        if len(parts) != 3 or parts[0] != "blame" or not parts[1].isdigit():
            continue
        generation, who = int(parts[1]), parts[2]
        plan = plans.get(generation)
        if plan is None or who not in members or entered.get(who, -1) > generation:
            continue
        found.append(Blame(generation, who, ""))
        for rank in value.decode(errors="replace").split(","):
            if rank.isdigit() and int(rank) < len(plan):
                blamed = plan[int(rank)]
                if blamed in members and blamed != who and \
                        entered.get(blamed, -1) <= generation:
                    found.append(Blame(generation, who, blamed))
    return sorted(set(found))


def to_evict(blames: Sequence[Blame], members: Sequence[str],
             decided: Collection[int] = ()) -> Dict[str, Tuple[int, str]]:
    """{worker: (generation, why)} to evict for `blames` (see the module's docstring).
    `decided`: generations in which an eviction for blames was made already: the blames
    the others made there while waiting on each other are left alone."""
    blamed_in = {(b.generation, b.blamer) for b in blames}
    blames = [b for b in blames if b.blamed]
    pairs = {(b.generation, b.blamer, b.blamed) for b in blames}
    found: Dict[str, Tuple[int, str]] = {}
    mutual = collections.defaultdict(list)
    for b in blames:
        if (b.generation, b.blamed, b.blamer) in pairs:
            mutual[b.generation].append(b)
        elif (b.generation, b.blamed) not in blamed_in:
            found.setdefault(b.blamed, (b.generation, f"was named by {b.blamer} as a rank "
                                                      "it lost"))
    for generation, left in sorted(mutual.items()):
        if generation in decided or any(g == generation for g, _ in found.values()):
            continue  # (a rank that named nobody is why the others wait on each other)
        while left:
            count = collections.Counter(b.blamed for b in left)
            loser = max(count, key=lambda w: (count[w], members.index(w)))
            others = sorted({b.blamer for b in left if b.blamed == loser})
            found.setdefault(loser, (generation, f"and {', '.join(others)} named each other "
                                                 f"as lost {PARTITION}: it is on the smaller "
                                                 "side, or the newer one"))
            left = [b for b in left if loser not in (b.blamer, b.blamed)]
    return found
