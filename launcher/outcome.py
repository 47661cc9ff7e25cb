"""What a job's end is summed up as: each rank's status, and the one line horolite-run prints.

The ranks' own reports come first (the runtime names the rank that failed first and
the ones stopped as a result); otherwise the wrappers' exit statuses, then mpirun's.
``JobOutcome`` is mixed into the Supervisor, whose state it reads.
"""
from __future__ import annotations

import dataclasses
import signal
from typing import Dict, Optional

__all__ = ["RankStatus", "JobResult", "JobOutcome", "describe_exit", "signame"]


@dataclasses.dataclass
class RankStatus:
    rank: int
    host: str = ""
    pid: int = 0
    pgid: int = 0
    started: bool = False
    code: Optional[int] = None
    signal: int = 0
    stopped: bool = False  # ended because the job was being stopped
    ended: float = 0.0  # wall-clock time the wrapper saw the command end (0: not reported)


@dataclasses.dataclass
class JobResult:
    exit_code: int
    message: str  # empty on success


def signame(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def describe_exit(status: RankStatus) -> str:
    # The pid of the rank's command (its process group leader), not of the wrapper around it.
    pid = status.pgid or status.pid
    where = f"rank {status.rank}" + (f" (host {status.host}, pid {pid})" if status.host else "")
    if status.signal:
        return f"{where} was killed by signal {status.signal} ({signame(status.signal)})"
    return f"{where} exited with code {status.code}"


class JobOutcome:
    """The job's summary from the Supervisor's state (ranks, cause, stopped_by,
    first_failure, interrupted, timed_out)."""

    ranks: Dict[int, RankStatus]
    cause: Optional[tuple]
    stopped_by: Dict[int, int]
    first_failure: Optional[RankStatus]
    interrupted: Optional[int]
    timed_out: bool

    def _reported_result(self) -> Optional[JobResult]:
        """The summary from the ranks' own reports: the rank that failed first, with its
        cause, then the ranks stopped as a result; None when no rank reported anything."""
        if self.cause is not None:
            kind, origin, text, code = self.cause
            status = self.ranks.get(origin)
            if kind == "stall":
                return JobResult(1, f"job failed: {text}; every rank was stopped")
            if status is not None and status.code and not status.stopped:
                code = status.code  # what the rank itself exited with
        elif self.stopped_by:
            origin = self._stopped_origin()
            status = self.ranks.get(origin)
            if status is None or (status.signal or status.code) and not status.stopped:
                return None  # it failed by itself (killed, say): the failure's own summary
            if status.code is None and self.first_failure is not None:
                # It never reported its end, and a rank did fail by itself: that rank's
                # death ended it too (mpirun cleans up around a killed rank), and the
                # others heard of the death through it.
                return None
            left = describe_exit(status) if status.code is not None else f"rank {origin} ended"
            text = f"{left} while other ranks still ran collectives"
            code = status.code or 1
        else:
            return None
        others = sorted(r for r in self.ranks if r != origin)
        message = f"job failed: {text}"
        if others:
            message += f"; ranks stopped as a result: {', '.join(map(str, others))}"
        return JobResult(code, message)

    def _stopped_origin(self) -> int:
        """The rank the runtime's "stopped" reports lead back to: each names the rank it
        heard from, which may itself have been stopped by another (a peer it lost)."""
        origins = set()
        for start in set(self.stopped_by.values()):
            rank, seen = start, set()
            while self.stopped_by.get(rank, -1) >= 0 and rank not in seen:
                seen.add(rank)
                rank = self.stopped_by[rank]
            origins.add(rank)
        if self.first_failure is not None and self.first_failure.rank in origins:
            return self.first_failure.rank
        return min(origins)

    def _result(self, returncode: int) -> JobResult:
        if self.interrupted is not None:
            return JobResult(128 + self.interrupted, f"stopped by {signame(self.interrupted)}")
        if self.timed_out:
            return JobResult(returncode or 1, "ranks did not start within --start-timeout")
        reported = self._reported_result()
        if reported is not None:
            return reported
        # A rank that reported being stopped by another rank's failure is not one of them.
        failures = [s for s in self.ranks.values()
                    if (s.code not in (None, 0) or s.signal) and not s.stopped
                    and s.rank not in self.stopped_by]
        failed = self.first_failure or (failures[0] if failures else None)
        if failed is not None:
            others = [s for s in failures if s is not failed]
            stopped = sorted(s.rank for s in self.ranks.values()
                             if s is not failed and s not in others and
                             (s.stopped or s.code is None or s.rank in self.stopped_by))
            message = f"job failed: {describe_exit(failed)}"
            if others:
                message += "; then " + "; ".join(describe_exit(s) for s in others)
            if stopped:
                message += f"; ranks stopped as a result: {', '.join(map(str, stopped))}"
            code = failed.code if failed.code else 1
            return JobResult(code, message)
        never = [r for r, s in self.ranks.items() if s.code is None]
        if returncode != 0 and not any(s.started for s in self.ranks.values()):
            return JobResult(returncode, f"mpirun failed (exit {returncode}) before any rank "
                                         f"started: see its messages above (for remote hosts: "
                                         f"are they reachable with ssh, without a password?)")
        if returncode != 0:
            detail = f"; no exit status from ranks {', '.join(map(str, never))}" if never else ""
            return JobResult(returncode, f"mpirun exited with code {returncode}{detail}")
        if never:
            return JobResult(1, f"no exit status from ranks {', '.join(map(str, never))}")
        return JobResult(0, "")
