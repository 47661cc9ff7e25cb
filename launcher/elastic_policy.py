"""How the --gloo elastic driver (elastic_gloo.py) judges what goes wrong: whom to evict
for the ranks' blames and for not arriving in a world, whether an error is the training
code's, and when the job must end because its progress would be lost."""
from __future__ import annotations

import sys
import time
from typing import Dict, List, Optional, Tuple

from .elastic_blames import PARTITION, standing, to_evict
from horolite.world.generations import SCOPE
from horolite.world.sockets import world_scope

__all__ = ["FailurePolicy", "BLAME_GRACE_SECONDS", "LATE_SLACK_SECONDS",
           "FAILURES_WITHOUT_COMMIT"]

# A worker the survivors name as lost whose process has not ended this long after is
# taken for hung (stopped, or on a host cut off) and ended.
BLAME_GRACE_SECONDS = 1.0
LATE_SLACK_SECONDS = 2.0  # after --gloo-timeout-seconds: the ranks' own blames come first
# Without --reset-limit: the job fails after this many failures in a row with no commit
# between them (a crash that comes back at the same batch whoever runs it).
FAILURES_WITHOUT_COMMIT = 10


def _log(message: str) -> None:
    print(f"horolite-run: elastic: {message}", file=sys.stderr, flush=True)


class FailurePolicy:
    """The driver's judgements (a mixin: the driver holds members, plans, the rendezvous
    server and the bookkeeping these read and update)."""

    def _training_code_error(self, blamed) -> Optional[str]:
        """The first error a worker named as its training code's that is one: not from a
        worker already evicted (stopped past the stall shutdown, cut off: whatever it
        meets when it comes back is its world's end), nor from one the survivors blame
        (it is evicted after its grace)."""
        if self.user_error is not None:
            return self.user_error
        for worker, text in list(self.user_errors):
            if worker.evicted is not None:
                self.user_errors.remove((worker, text))
                _log(f"{worker.name} (host {worker.host}) was already evicted ({worker.evicted}):"
                     f" its error is not the training code's: {text}")
            elif worker not in blamed:
                return f"{worker.name} (host {worker.host}): {text}"
        return None

    def _entered(self) -> Dict[str, int]:
        return {k: int(v) for k, v in self._said("entered").items() if v.lstrip("-").isdigit()}

    def _blamed(self) -> Dict[object, Tuple[int, str]]:
        """Members the others named as lost, or waited for in vain (elastic_blames.py):
        {worker: (the generation of the blame, why)}."""
        names = [w.name for w in self.members]
        blames = standing(self.server.items(SCOPE), self.plans, names, self._entered())
        by_name = {w.name: w for w in self.members}
        return {by_name[n]: found for n, found in
                to_evict(blames, names, self.decided).items()}

    def _late(self) -> List[Tuple[object, str]]:
        """Members that did not arrive in the current generation within
        --gloo-timeout-seconds of the first rank that was already in a world (a new
        worker waits from its start; the others come at a failure or their next commit):
        the launcher's own view of who stops a world from forming."""
        n, entered = self.generation, self._entered()
        if n == 0 or all(entered.get(w.name, -1) >= n for w in self.members):
            self.arriving = None
            return []
        arrived = {int(k) for k in self.server.items(world_scope(n)) if k.isdigit()}
        if self.arriving is None or self.arriving[0] != n:
            if not any(r in arrived and (w.name in entered or w in self.holders)
                       for r, w in enumerate(self.ranked) if w in self.members):
                return []
            self.arriving = (n, time.monotonic())
        timeout = getattr(self.config, "gloo_timeout", None) or 30.0
        if time.monotonic() - self.arriving[1] < timeout + LATE_SLACK_SECONDS:
            return []
        return [(w, f"did not arrive in generation {n} within --gloo-timeout-seconds "
                    f"{timeout:g}") for r, w in enumerate(self.ranked)
                if w in self.members and r not in arrived]

    def _hung(self, blamed, lost) -> List[Tuple[object, str]]:
        """The blamed members to end now: each has a grace per generation it is blamed
        in, to say whom it lost itself (then it left that world on purpose); the losers of
        a partition go together, once the first of them is due."""
        now, due = time.monotonic(), set()
        for worker, (generation, why) in blamed.items():
            if now - self.blamed_at.setdefault((generation, worker), now) >= BLAME_GRACE_SECONDS:
                due.add((generation, worker))
        split = {g for g, w in due if PARTITION in blamed[w][1]}
        found = []
        for worker, (generation, why) in blamed.items():
            if any(w is worker for w, _ in lost) or worker.proc.poll() is not None:
                continue  # (its end says more than the blame: it is seen next turn)
            if (generation, worker) in due or (generation in split and PARTITION in why):
                found.append((worker, why))
                self.decided.add(generation)
        return found

    def _state_lost(self) -> Optional[int]:
        """1 when no member left holds the training state (every one that did was lost):
        newcomers would train again from their initial values, losing every commit."""
        synced = self._said("synced")
        self.holders.update(w for w in self.workers if w.name in synced)
        if any(w in self.holders for w in self.members):
            return None
        _log(f"generation {self.generation}: {'; '.join(self.said)}: no worker left holds the "
             "training state (every member that held its last commit was lost); the job fails "
             "rather than train again from the initial values")
        return 1

    def _progress(self, failed: bool) -> Optional[str]:
        """Why the job must end for failures that repeat with no commit between them (the
        default bound when --reset-limit is not given), or None."""
        commit = self.server.items(SCOPE).get("commit", b"")
        if commit != self.last_commit:
            self.last_commit, self.failures_in_a_row = commit, 0
        if not failed:
            return None
        self.failures_in_a_row += 1
        if self.ecfg.reset_limit is None and self.failures_in_a_row > FAILURES_WITHOUT_COMMIT:
            return (f"that is failure {self.failures_in_a_row} in a row with no commit between "
                    f"them (more than {FAILURES_WITHOUT_COMMIT} without --reset-limit)")
        return None
