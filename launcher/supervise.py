"""Run the mpirun command, relay its output, and end the job cleanly.

The supervisor owns one mpirun process (in its own session, so a terminal's
Ctrl-C reaches only the launcher) and two reader threads that copy mpirun's
output to ours while picking out the rank wrappers' marker lines. The main
thread waits on those events and enforces three rules:

- a rank that fails (non-zero exit or signal) gets the job stopped: once every rank has
  reported how it ended, or ``fail_grace`` seconds after the failure, mpirun gets SIGTERM,
  then SIGKILL. A failed rank's wrapper holds its end until then (rankwrap.py ``--hold``),
  so mpirun's own clean-up, which starts as the first wrapper ends with an error, cannot cut
  off a report still on its way (a rank killed outright, whose wrapper runs late);
- SIGINT/SIGTERM/SIGHUP to the launcher is forwarded to mpirun, with the same
  escalation (a second signal escalates at once);
- every rank must report that it started within ``start_timeout`` seconds.

The last resort kills, on this host, each rank wrapper and its command's
process group, whose ids the wrappers reported.
"""
from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence

from . import hosts as hostlib
from .markers import HYDRA_LINE, marker_line, parse_marker
from .outcome import JobOutcome, JobResult, RankStatus, describe_exit, signame
from .processes import descendants, proc_table, set_session_and_parent_death
from .rankwrap import MARKER
from .shm_cleanup import ShmLeftovers

__all__ = ["RankStatus", "JobResult", "Supervisor", "parse_marker", "describe_exit"]

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_RUNTIME_MARKERS = ("cause", "stopped", "stall")


def _seconds(fields, name: str) -> float:
    """A time field of a marker; 0.0 when it is absent or unreadable (an older wrapper)."""
    try:
        return float(fields.get(name, 0))
    except ValueError:
        return 0.0


class Supervisor(JobOutcome):
    def __init__(self, argv: Sequence[str], num_proc: int, rank_hosts: Sequence[str], *,
                 start_timeout: float, fail_grace: float = 2.0, kill_grace: float = 3.0,
                 log=None, start_help: str = "", env=None, on_marker=None,
                 stdin: Optional[bytes] = None):
        self.argv = list(argv)
        self.stdin = stdin  # written to mpirun's stdin, which then closes (None: ours)
        self.num_proc = num_proc
        self.rank_hosts = list(rank_hosts)
        self.start_timeout = start_timeout
        self.start_help = start_help or "Check that these hosts are reachable (ssh without a password)"
        self.fail_grace = fail_grace
        self.env = env  # mpirun's environment (None: this one)
        # Called with (kind, fields) for marker kinds the supervisor does not know itself
        # (the elastic driver's, launcher/elastic.py).
        self.on_marker = on_marker
        self.kill_grace = kill_grace
        self.ranks: Dict[int, RankStatus] = {r: RankStatus(r) for r in range(num_proc)}
        self.events: "queue.Queue" = queue.Queue()
        self.first_failure: Optional[RankStatus] = None
        # The runtime's own reports: (kind, rank, text, exit code) of the first failure it
        # announced, and which rank each stopped rank was stopped by.
        self.cause: Optional[tuple] = None
        self.cause_at = 0.0  # when the rank reported it, for a signal from outside
        self.stopped_by: Dict[int, int] = {}
        # Rank 0's straggler record (horolite/coordination/straggler_round.py): its latest
        # line naming a rank ("window"), and the job's summary at a clean end ("job").
        self.stragglers: Dict[str, str] = {}
        self.shm = ShmLeftovers()
        self._stopping = False  # the launcher has signalled mpirun
        self.interrupted: Optional[int] = None
        self.timed_out = False
        self._signals: List[int] = []
        # Set as soon as a failure or a signal is seen: hydra's error stack is noise from then on.
        self._hydra_noise_expected = threading.Event()
        self._log = log or (lambda msg: print(f"horolite-run: {msg}", file=sys.stderr, flush=True))

    # --- output relay (reader threads) ---
    def _relay(self, pipe, out, parse: bool):
        for raw in iter(pipe.readline, b""):
            marker = marker_line(raw) if parse and MARKER.encode() in raw else None
            if marker is not None:
                parsed = parse_marker(marker.decode(errors="replace"))
                if parsed:
                    if parsed[0] == "exit" and self._failed(parsed[1]):
                        self._hydra_noise_expected.set()
                    self.events.put(parsed)
                    continue
            if parse and self._hydra_noise_expected.is_set() and HYDRA_LINE.match(raw):
                continue
            try:
                out.write(raw)
                out.flush()
            except (OSError, ValueError):
                pass
        pipe.close()

    def _on_signal(self, signum, frame):
        self._signals.append(signum)
        self._hydra_noise_expected.set()
        self.events.put(("signal", {}))

    # --- main loop ---
    def run(self) -> JobResult:
        previous = {s: signal.getsignal(s) for s in _STOP_SIGNALS}
        for s in _STOP_SIGNALS:
            signal.signal(s, self._on_signal)
        try:
            return self._run()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _run(self) -> JobResult:
        try:
            proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    preexec_fn=set_session_and_parent_death, env=self.env,
                                    stdin=None if self.stdin is None else subprocess.PIPE)
        except OSError as e:
            return JobResult(127, f"cannot run {self.argv[0]}: {e.strerror}")
        self.proc = proc
        if self.stdin is not None:
            try:
                proc.stdin.write(self.stdin)
                proc.stdin.close()
            except OSError:
                pass  # it ended at once: its exit status says the rest
        out = getattr(sys.stdout, "buffer", sys.stdout)
        err = getattr(sys.stderr, "buffer", sys.stderr)
        readers = [threading.Thread(target=self._relay, args=(proc.stdout, out, False),
                                    name="horolite-run-stdout", daemon=True),
                   threading.Thread(target=self._relay, args=(proc.stderr, err, True),
                                    name="horolite-run-stderr", daemon=True)]
        for t in readers:
            t.start()
        start_deadline = time.monotonic() + self.start_timeout
        self._tree: Dict[int, bytes] = {}  # the job's processes on this host, seen so far
        next_scan = 0.0
        stop_at: Optional[float] = None  # when to send SIGTERM to mpirun
        kill_at: Optional[float] = None  # when to SIGKILL everything left
        while True:
            try:
                kind, fields = self.events.get(timeout=0.1)
            except queue.Empty:
                kind, fields = None, None
            now = time.monotonic()
            if kind == "shm":
                self._shm_report(fields)
            elif kind in _RUNTIME_MARKERS:
                if self._runtime_report(kind, fields) and stop_at is None and kill_at is None:
                    self._hydra_noise_expected.set()
                    stop_at = now + self.fail_grace
            elif kind in ("start", "exit"):
                self._record(kind, fields)
                if kind == "exit" and self._first_failure(fields) == "first":
                    if self.num_proc > 1 and self.cause is None:
                        self._log(f"{describe_exit(self.first_failure)}; stopping the other ranks")
                    if stop_at is None:
                        stop_at = now + self.fail_grace
                elif kind == "exit" and stop_at is None and kill_at is None and \
                        int(fields.get("rank", -1)) in self.stopped_by:
                    stop_at = now + self.fail_grace  # stopped by another rank: end the job too
                if kind == "exit" and stop_at is not None and self._all_reported():
                    stop_at = now  # nothing more to hear: end the held wrappers now
            elif kind == "straggler":
                self._straggler(fields)
            elif kind not in (None, "signal") and self.on_marker is not None:
                self.on_marker(kind, fields)
            elif kind == "signal":
                while self._signals:
                    signum = self._signals.pop(0)
                    if self.interrupted is None:
                        self.interrupted = signum
                        self._log(f"got {signame(signum)}: stopping all ranks")
                        self._send(signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM)
                        stop_at = None
                        kill_at = now + self.kill_grace
                    else:
                        kill_at = now  # a second Ctrl-C: no more waiting
            if proc.poll() is not None:
                break
            if now >= next_scan:
                next_scan = now + 0.5
                self._tree.update(descendants(proc.pid))
                self.shm.scan(self._tree)
            if not self.timed_out and now >= start_deadline and \
                    not all(r.started for r in self.ranks.values()):
                self.timed_out = True
                self._hydra_noise_expected.set()
                self._log(self._start_timeout_message())
                self._send(signal.SIGTERM)
                kill_at = now + self.kill_grace
            if stop_at is not None and now >= stop_at:
                stop_at = None
                self._send(signal.SIGTERM)
                kill_at = now + self.kill_grace if kill_at is None else kill_at
            if kill_at is not None and now >= kill_at:
                kill_at = None
                self._log("ranks still running after SIGTERM: sending SIGKILL")
                self._kill_everything()
        returncode = proc.wait()
        # Ranks whose exit lines are still in the pipes: drain them.
        for t in readers:
            t.join(timeout=2.0)
        while not self.events.empty():
            kind, fields = self.events.get_nowait()
            if kind == "shm":
                self._shm_report(fields)
            elif kind in _RUNTIME_MARKERS:
                self._runtime_report(kind, fields)
            elif kind in ("start", "exit"):
                self._record(kind, fields)
                if kind == "exit":
                    self._first_failure(fields)
            elif kind == "straggler":
                self._straggler(fields)
            elif kind != "signal" and self.on_marker is not None:
                self.on_marker(kind, fields)
        self._kill_local_leftovers()
        result = self._result(returncode)
        if result.exit_code != 0:
            self._kill_tree_leftovers()
        removed = self.shm.remove_leftovers()
        if removed:
            self._log(f"removed {len(removed)} shared-memory segment(s) the job left in "
                      f"/dev/shm: {', '.join(os.path.basename(p) for p in removed)}")
        if result.exit_code != 0:  # a clean end leaves nothing: MPI_Finalize unlinks them
            for host, files in sorted(self.shm.remove_remote(self.argv).items()):
                self._log(f"removed {len(files)} shared-memory segment(s) the job left in "
                          f"/dev/shm on {host}: {', '.join(os.path.basename(p) for p in files)}")
        return result

    def _all_reported(self) -> bool:
        return all(s.code is not None for s in self.ranks.values())

    def _straggler(self, fields) -> None:
        self.stragglers[fields.get("when", "window")] = fields.get("text", "")

    def _shm_report(self, fields) -> None:
        """A rank's own list of its /dev/shm files, on this host or another."""
        host = fields.get("host")
        self.shm.reported(fields.get("text", "").split(),
                          None if host in (None, socket.gethostname()) else host)

    def _runtime_report(self, kind, fields) -> bool:
        """A rank's own account (horolite/failure/channel.py): True when it ends the job."""
        try:
            rank = int(fields.get("rank", -1))
        except ValueError:
            return False
        if kind == "stopped":
            # Not once the launcher has signalled mpirun: a rank that heard of a failure
            # then may have heard of another rank's SIGTERM, which is only a consequence.
            if not self._stopping:
                self.stopped_by.setdefault(rank, int(fields.get("by", -1)))
            return False
        # Only the first account of a job still running normally: once a rank has failed
        # or the launcher stops the job, a rank reporting its SIGTERM is a consequence.
        if self.cause is None and self.first_failure is None and not self._stopping and \
                self.interrupted is None and not self.timed_out:
            self.cause = (kind, rank, fields.get("text", ""), int(fields.get("code", 1) or 1))
            self.cause_at = _seconds(fields, "at")
            self._log(f"{self.cause[2]}; stopping the other ranks" if self.num_proc > 1
                      else self.cause[2])
            return True
        return False

    def _kill_tree_leftovers(self):
        """After a failed job, whatever mpirun started here and left behind (a hung ssh...)."""
        if not self._tree:
            return
        time.sleep(0.2)  # let processes that are already ending go by themselves
        table = proc_table()
        for pid, start in self._tree.items():
            if pid in table and table[pid][1] == start:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def _failed(self, fields) -> bool:
        return (int(fields.get("code", 0)) != 0 or int(fields.get("signal", 0)) != 0) and \
            fields.get("stopped") != "1" and self.interrupted is None and not self.timed_out \
            and int(fields.get("rank", -1)) not in self.stopped_by  # a consequence, reported

    def _first_failure(self, fields) -> Optional[str]:
        """Whether a rank's exit report makes it the job's first failure: "first" when it is
        the first failed rank heard of, "earlier" when it ended before the one taken so far.

        Reports can arrive out of order (Open MPI relays each host's output on its own), and
        a rank killed outright makes its peers abort on the broken connection, or Open MPI
        stop them with SIGTERM; the wrappers' end times, and the time a rank reports its
        signal at, tell which came first."""
        if not self._failed(fields):
            return None
        status = self.ranks.get(int(fields["rank"]))
        if status is None:
            return None
        if self.cause is not None and self.cause_at and status.ended and \
                status.ended < self.cause_at and status.rank != self.cause[1]:
            # The reported cause was a signal from outside, sent after this rank ended.
            self.cause, self.first_failure = None, status
            return "earlier"
        if self.first_failure is None:
            self.first_failure = status
            return "first"
        taken = self.first_failure
        if status.ended and taken.ended and status.ended < taken.ended:
            self.first_failure = status
            return "earlier"
        return None

    def _record(self, kind, fields):
        try:
            status = self.ranks[int(fields["rank"])]
        except (KeyError, ValueError):
            return
        status.host = fields.get("host", status.host)
        if kind == "start":
            status.started = True
            status.pid = int(fields.get("pid", 0))
            status.pgid = int(fields.get("pgid", 0))
        else:
            status.code = int(fields.get("code", 0))
            status.signal = int(fields.get("signal", 0))
            status.stopped = fields.get("stopped") == "1"
            status.ended = _seconds(fields, "ended")

    def _send(self, signum):
        self._stopping = True
        try:
            os.kill(self.proc.pid, signum)
        except ProcessLookupError:
            pass

    def _kill_local_leftovers(self, signum=signal.SIGKILL):
        """Rank wrappers on this host that never reported an exit, and their commands."""
        for status in self.ranks.values():
            if not status.started or status.code is not None or not hostlib.is_local(status.host):
                continue
            for pgid in (status.pgid, status.pid):
                if pgid > 1:
                    try:
                        os.killpg(pgid, signum)
                    except (ProcessLookupError, PermissionError):
                        pass

    def _kill_everything(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._kill_local_leftovers()

    def _start_timeout_message(self) -> str:
        missing = [r for r, s in self.ranks.items() if not s.started]
        where = sorted({self.rank_hosts[r] for r in missing if r < len(self.rank_hosts)})
        return (f"only {self.num_proc - len(missing)} of {self.num_proc} ranks started within "
                f"--start-timeout {self.start_timeout:g}s; missing ranks "
                f"{', '.join(map(str, missing))} (on {', '.join(where) or 'unknown hosts'}). "
                f"{self.start_help}, and that {sys.executable} exists there")
