"""``horolite-run --gloo``'s own small mpirun: starts every rank of a plan, relays output.

The launcher's Supervisor (supervise.py) runs one process and reads the rank wrappers'
marker lines from its output; with mpirun that process is mpirun. Without MPI it is
this one, so the supervisor's rules (failures, signals, start timeout, the summary) stay
one piece of code for both ways of starting ranks.

The plan comes as JSON on stdin (never on a command line: it holds the job's key):
``{"cwd": dir, "ranks": [{"rank", "host", "argv", "env", "remote"}, ...]}``.

- A local rank runs ``argv`` (the rank wrapper and the command) with ``env`` added to
  this process's environment.
- A remote rank runs ``argv`` (ssh to its host, running the wrapper with
  ``--env-stdin``) and gets ``{"env", "cwd"}`` as the first line of ssh's stdin; a
  signal for it goes down the same line (``SIGTERM``), and the line's end tells the
  wrapper that the launcher is gone.
- Output is relayed a whole line at a time, stdout to stdout and stderr to stderr.
- SIGINT/SIGTERM/SIGHUP are forwarded to every rank; the supervisor's SIGKILL takes
  this process's group (the local wrappers and the ssh clients) with it.
- A wrapper that ends without its exit report (it was killed, or its ssh failed) gets
  one written for it, so the supervisor stops the job at once and names the rank.

Exits with the first failed rank's code (0 when every rank ended well). Standard
library only, run as a plain file (like rankwrap.py). Its arguments (``--ssh-args ...``)
are not read here: they tell the supervisor's clean-up how the hosts were reached
(shm_cleanup.remote_command).
"""
import json
import os
import selectors
import signal
import subprocess
import sys
import time

from rankwrap import MARKER, write_all  # (its neighbour in this folder: both run as plain files)
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _parent_death():  # in each child, between fork and exec
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
        except Exception:
            pass


class Rank:
    """One started rank: its wrapper (or the ssh to it), its pipes, what it reported."""

    def __init__(self, spec, cwd, size):
        self.rank, self.host, self.remote = spec["rank"], spec["host"], spec["remote"]
        self.size = size
        self.started = self.reported = False
        env = None if self.remote else dict(os.environ, **spec["env"])
        self.proc = subprocess.Popen(spec["argv"], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, preexec_fn=_parent_death,
                                     stdin=subprocess.PIPE if self.remote else subprocess.DEVNULL)
        self.partial = {self.proc.stdout.fileno(): b"", self.proc.stderr.fileno(): b""}
        self.open_pipes = 2
        if self.remote:
            self.tell(json.dumps({"env": spec["env"], "cwd": cwd}))

    def tell(self, line):
        """A line down ssh's stdin to the remote wrapper (its environment, a signal)."""
        try:
            self.proc.stdin.write(line.encode() + b"\n")
            self.proc.stdin.flush()
        except (OSError, ValueError):
            pass  # ssh is gone: its own end says the rest

    def signal(self, signum):
        if self.proc.poll() is not None:
            return
        if self.remote:
            self.tell(signal.Signals(signum).name)
        else:
            try:
                os.kill(self.proc.pid, signum)
            except ProcessLookupError:
                pass

    def lines(self, fd, data):
        """Whole lines from one pipe (the rest waits for more); noting the wrapper's reports."""
        data = self.partial[fd] + data
        *done, self.partial[fd] = data.split(b"\n")
        for line in done:
            if line.startswith(f"{MARKER} start ".encode()):
                self.started = True
            elif line.startswith(f"{MARKER} exit ".encode()):
                self.reported = True
        return b"".join(line + b"\n" for line in done)

    def missing_report(self, stopping):
        """The marker lines for a wrapper that ended without reporting how (none if it did)."""
        if self.reported:
            return b""
        code = self.proc.returncode
        signum = -code if code < 0 else 0
        code = 128 + signum if signum else code
        how = f"was killed by signal {signum}" if signum else f"exited with code {code}"
        what = "ssh to" if self.remote else "the wrapper on"
        text = (f"horolite-run: {what} {self.host} for rank {self.rank} {how} before the "
                f"rank reported its end\n")
        fields = f"rank={self.rank} size={self.size} host={self.host}"
        start = "" if self.started else f"{MARKER} start {fields} pid={self.proc.pid} pgid=0\n"
        end = (f"{MARKER} exit {fields} code={code} signal={signum} stopped={int(stopping)} "
               f"ended={time.time():.6f}\n")
        return ("" if stopping else text).encode() + (start + end).encode()


def main():
    plan = json.loads(sys.stdin.buffer.read())
    state = {"stopping": False}
    ranks = []

    def on_signal(signum, frame):
        state["stopping"] = True
        for r in ranks:
            r.signal(signum)

    for signum in _FORWARDED:
        signal.signal(signum, on_signal)
    size = len(plan["ranks"])
    for spec in plan["ranks"]:
        if state["stopping"]:  # stopped while starting: start no more
            break
        try:
            ranks.append(Rank(spec, plan["cwd"], size))
        except OSError as e:
            write_all(2, f"horolite-run: cannot start rank {spec['rank']} on {spec['host']}: "
                      f"{e.strerror}\n".encode())
            on_signal(signal.SIGTERM, None)
            break
    selector = selectors.DefaultSelector()
    for r in ranks:
        selector.register(r.proc.stdout, selectors.EVENT_READ, (r, 1))
        selector.register(r.proc.stderr, selectors.EVENT_READ, (r, 2))
    first_failure = 0 if len(ranks) == size else 1  # a rank that could not start failed
    while selector.get_map():
        for key, _ in selector.select():
            r, out = key.data
            data = os.read(key.fd, 65536)
            if data:
                write_all(out, r.lines(key.fd, data))
                continue
            # The end of this pipe: its last line, however it ended.
            write_all(out, r.lines(key.fd, b"\n") if r.partial[key.fd] else b"")
            selector.unregister(key.fileobj)
            r.open_pipes -= 1
            if r.open_pipes:
                continue
            r.proc.wait()  # both pipes closed: the wrapper (or ssh) has ended, or soon will
            if r.remote:
                try:
                    r.proc.stdin.close()
                except OSError:
                    pass
            write_all(2, r.missing_report(state["stopping"]))
            code = r.proc.returncode
            if code and not first_failure:
                first_failure = 128 - code if code < 0 else code
    return first_failure


if __name__ == "__main__":
    sys.exit(main())
