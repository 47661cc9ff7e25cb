"""One rank's wrapper: runs the user command, prefixes its output, reports how it ended.

``horolite-run`` starts every rank as ``python rankwrap.py [options] -- command``.
Standard library only, and runnable as a plain file, so it works wherever the
same Python exists (remote hosts included) without importing horolite.

- Output lines become ``[<rank>]<stdout>:line`` / ``[<rank>]<stderr>:line``;
  with ``--output-dir DIR`` the raw output also goes to ``DIR/rank.<rank>/stdout``
  and ``.../stderr``.
- Marker lines on stderr tell the launcher that the rank started and how it
  ended (``##horolite-run## start ...`` / ``##horolite-run## exit ...``).
- The command runs in its own process group with a parent-death signal; SIGINT,
  SIGTERM and SIGHUP are forwarded to that group and escalate to SIGKILL after
  ``--grace`` seconds; whatever is left of the group when the command ends is
  killed. So no process outlives its rank.
- A command that failed (non-zero exit, or a signal not forwarded by the wrapper) is
  reported at once, but with ``--hold S`` its wrapper stays up to S seconds more, until a
  signal or until the MPI daemon above it is gone: mpirun ends every rank once one wrapper
  ends with an error, and that would cut off the report of a rank still on its way (a rank
  killed outright on a busy host, whose wrapper had not run yet). horolite-run ends the job
  itself once every rank has reported (launcher/supervise.py).
- With ``--env-stdin`` (``horolite-run --gloo`` over ssh) the first line on stdin is the
  rank's environment and working directory as JSON, so nothing secret is on a command line;
  later lines name a signal to forward (``SIGTERM``), and the end of stdin (horolite-run or
  its ssh gone) is a SIGTERM. The command then gets no stdin.
- The wrapper exits with the command's exit code (128+N for signal N).
"""
import argparse
import functools
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time

MARKER = "##horolite-run##"
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def rank_and_size(environ=None):
    """This process's rank and world size as set by MPICH hydra or Open MPI (PRRTE)."""
    environ = os.environ if environ is None else environ
    rank = size = None
    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "HOROLITE_RANK"):
        if environ.get(name, "").isdigit():
            rank = int(environ[name])
            break
    for name in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "HOROLITE_SIZE"):
        if environ.get(name, "").isdigit():
            size = int(environ[name])
            break
    return (0 if rank is None else rank), (1 if size is None else size)


def _child_setup(wrapper_pid: int) -> None:  # runs in the child between fork and exec
    os.setpgid(0, 0)
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        except Exception:
            pass
    # A wrapper that died before the line above (a SIGTERM as it started: an elastic
    # job's end stops a worker that was still starting) sends no signal: the command
    # would run on alone, orphaned.
    if os.getppid() != wrapper_pid:
        os._exit(128 + int(signal.SIGKILL))


class _Stream:
    """Splits one of the child's pipes into prefixed lines; tees raw bytes to a file."""

    def __init__(self, fd_out, prefix, copy=None, timestamp=False):
        self.fd_out = fd_out
        self._prefix = prefix
        self.timestamp = timestamp  # horovodrun's --prefix-output-with-timestamp
        self.copy = copy
        self.partial = b""

    @property
    def prefix(self):
        if not self.timestamp:
            return self._prefix
        return time.strftime("%a %b %d %H:%M:%S %Y").encode() + self._prefix

    def feed(self, data):
        if self.copy is not None:
            self.copy.write(data)
            self.copy.flush()
        data = self.partial + data
        lines = data.split(b"\n")
        self.partial = lines.pop()
        if lines:
            prefix = self.prefix
            write_all(self.fd_out, b"".join(prefix + line + b"\n" for line in lines))

    def close(self):
        if self.partial:
            write_all(self.fd_out, self.prefix + self.partial + b"\n")
            self.partial = b""
        if self.copy is not None:
            self.copy.close()


def write_all(fd, data):
    """All of `data` to `fd` (rank_spawn.py's relay writes with it too)."""
    while data:
        try:
            n = os.write(fd, data)
        except InterruptedError:
            continue
        except OSError:  # the reader is gone; keep draining the child (or the ranks)
            return
        data = data[n:]


class _Control:
    """horolite-run's line to a wrapper it started over ssh (--env-stdin): ssh's stdin."""

    def __init__(self, fd=0):
        self.fd = fd
        self.buffer = b""

    def first_line(self):
        """The rank's {"env": {...}, "cwd": ...}, sent before anything else."""
        while b"\n" not in self.buffer:
            data = os.read(self.fd, 65536)
            if not data:
                raise SystemExit("rankwrap: --env-stdin: stdin ended before the environment")
            self.buffer += data
        line, _, self.buffer = self.buffer.partition(b"\n")
        return json.loads(line)

    def signals(self, data):
        """The signals asked for by the complete lines so far; None once stdin has ended."""
        if not data and data is not None:
            return None
        self.buffer += data or b""
        *lines, self.buffer = self.buffer.split(b"\n")
        names = [line.decode(errors="replace").strip() for line in lines if line.strip()]
        return [getattr(signal, n, signal.SIGTERM) if n in ("SIGINT", "SIGTERM", "SIGHUP")
                else signal.SIGTERM for n in names]


def _marker(kind, **fields):
    text = " ".join(f"{k}={v}" for k, v in fields.items())
    write_all(2, f"{MARKER} {kind} {text}\n".encode())


def main(argv=None):
    parser = argparse.ArgumentParser(prog="rankwrap", description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default=None)
    parser.add_argument("--timestamp", action="store_true", help="time in front of every line")
    parser.add_argument("--grace", type=float, default=3.0,
                        help="seconds between forwarding a signal and SIGKILL")
    parser.add_argument("--hold", type=float, default=0.0,
                        help="after a failed command, seconds to stay up (until a signal) "
                             "before ending")
    parser.add_argument("--env-stdin", action="store_true",
                        help="read the rank's environment as one JSON line on stdin, then "
                             "signals to forward (horolite-run --gloo over ssh)")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    control = _Control() if args.env_stdin else None
    if control is not None:
        given = control.first_line()
        os.environ.update(given.get("env", {}))
        try:
            os.chdir(given.get("cwd") or ".")
        except OSError:
            pass  # as mpirun: a directory this host lacks leaves the login directory
    rank, size = rank_and_size()
    host = socket.gethostname()
    copies = {}
    if args.output_dir:
        rank_dir = os.path.join(args.output_dir, f"rank.{rank}")
        os.makedirs(rank_dir, exist_ok=True)
        for name in ("stdout", "stderr"):
            copies[name] = open(os.path.join(rank_dir, name), "wb")
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")  # rank output shows up as it is printed

    state = {"signal": None, "kill_at": None, "held": False}

    def on_signal(signum, frame):
        if state["signal"] is None:
            state["signal"] = signum
            state["kill_at"] = time.monotonic() + args.grace
        if state["held"]:
            return  # the command is gone (its group id may be another's by now)
        try:
            os.killpg(child.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    try:
        # close_fds=False: MPICH hands each rank an inherited PMI socket (PMI_FD).
        child = subprocess.Popen(command, stdout=subprocess.PIPE,
                                 stdin=subprocess.DEVNULL if control is not None else None,
                                 stderr=subprocess.PIPE, close_fds=False, env=env,
                                 preexec_fn=functools.partial(_child_setup, os.getpid()))
    except OSError as e:
        code = 127 if isinstance(e, FileNotFoundError) else 126
        write_all(2, f"[{rank}]<stderr>:horolite-run: cannot run {command[0]!r}: {e.strerror}\n"
               .encode())
        _marker("start", rank=rank, size=size, host=host, pid=os.getpid(), pgid=0)
        _marker("exit", rank=rank, size=size, host=host, code=code, signal=0, stopped=0)
        return code
    for signum in _FORWARDED:
        signal.signal(signum, on_signal)
    _marker("start", rank=rank, size=size, host=host, pid=os.getpid(), pgid=child.pid)

    parent = os.getppid()
    streams = {
        child.stdout.fileno(): _Stream(1, f"[{rank}]<stdout>:".encode(), copies.get("stdout"),
                                         args.timestamp),
        child.stderr.fileno(): _Stream(2, f"[{rank}]<stderr>:".encode(), copies.get("stderr"),
                                         args.timestamp),
    }
    selector = selectors.DefaultSelector()
    for fd in streams:
        selector.register(fd, selectors.EVENT_READ)
    if control is not None:
        selector.register(control.fd, selectors.EVENT_READ)
        for signum in control.signals(None):  # lines that came with the environment
            on_signal(signum, None)
    exited_at = None
    # When the command ended, by this host's clock: its pipes closing is the first sign.
    # The launcher orders failures on different hosts by it.
    ended = None
    while streams:
        for key, _ in selector.select(timeout=0.2):
            data = os.read(key.fd, 65536)
            if control is not None and key.fd == control.fd:
                asked = control.signals(data)
                if asked is None:  # horolite-run (or the ssh to it) is gone: end the rank
                    selector.unregister(key.fd)
                    asked = [signal.SIGTERM]
                for signum in asked:
                    on_signal(signum, None)
            elif data:
                streams[key.fd].feed(data)
            else:
                selector.unregister(key.fd)
                streams.pop(key.fd).close()
                if not streams and ended is None:
                    ended = time.time()
        now = time.monotonic()
        if state["kill_at"] is not None and now >= state["kill_at"]:
            state["kill_at"] = None
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if state["signal"] is None and os.getppid() != parent:
            on_signal(signal.SIGTERM, None)  # our MPI daemon is gone: end the rank
        if exited_at is None and child.poll() is not None:
            exited_at = now
            ended = time.time() if ended is None else ended
        if exited_at is not None and now - exited_at > 1.0:
            break  # leftover processes hold the pipes open; they are killed below
    for stream in streams.values():
        stream.close()
    returncode = child.wait()
    try:
        os.killpg(child.pid, signal.SIGKILL)  # anything the command left behind
    except (ProcessLookupError, PermissionError):
        pass
    signum = -returncode if returncode < 0 else 0
    code = 128 + signum if signum else returncode
    _marker("exit", rank=rank, size=size, host=host, code=code, signal=signum,
            stopped=int(state["signal"] is not None),
            ended=f"{time.time() if ended is None else ended:.6f}")
    if code != 0 and state["signal"] is None and args.hold > 0:
        state["held"] = True
        _hold(args.hold, parent, state)
    return code


def _hold(seconds, parent, state):
    """Stay up after a failure was reported, until a signal comes (horolite-run ending
    the job), the MPI daemon above is gone, or `seconds` pass."""
    until = time.monotonic() + seconds
    while state["signal"] is None and os.getppid() == parent and time.monotonic() < until:
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
