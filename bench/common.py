"""What every benchmark shares: arguments, timing, bandwidth, targets, output.

Each script times its own work with `median_time` (the median over iterations
of the slowest rank's time), records rows and targets, and hands them to
`finish`, which rank 0 turns into a JSON file, an optional PNG plot (skipped,
with a message, when matplotlib is missing) and a Markdown table printed and
saved next to the JSON.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import resource
import shutil
import socket
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

__all__ = ["machine_busy", "wait_until_quiet", "parser", "median_time", "busbw", "Target", "finish", "human_bytes", "polite_barrier",
           "free_port", "child_env"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")


def _cpu_snapshot():
    """(wall seconds, busy CPU-seconds of the whole machine, CPU-seconds of this process
    and its finished children)."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
        busy = (sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        busy = float("nan")
    own = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):  # children: the TF workers
        ru = resource.getrusage(who)
        own += ru.ru_utime + ru.ru_stime
    return time.monotonic(), busy, own


_START = _cpu_snapshot()


def other_busy_so_far() -> float:
    """Fraction of the cores other processes used since this process started (approximate:
    this process's own CPU time only, so call it where the other ranks are similar)."""
    t1, b1, own1 = _cpu_snapshot()
    t0, b0, own0 = _START
    ranks = int(os.environ.get("PMI_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))
    return max(0.0, ((b1 - b0) - ranks * (own1 - own0)) / ((t1 - t0) * (os.cpu_count() or 1)))


def machine_busy(seconds: float = 1.0) -> float:
    """Fraction of all cores busy over the next `seconds` (any process)."""
    t0, b0, _ = _cpu_snapshot()
    time.sleep(seconds)
    t1, b1, _ = _cpu_snapshot()
    return (b1 - b0) / ((t1 - t0) * (os.cpu_count() or 1))


def wait_until_quiet(comm, max_busy: float, timeout: float) -> float:
    """Rank 0 waits (up to timeout s) until other processes use < max_busy of the cores.

    Benchmarks share the machine with whatever else runs; this avoids starting
    under someone's compile. Returns the last busy fraction measured.
    """
    busy = float("nan")
    if comm.Get_rank() == 0 and max_busy < 1:
        deadline = time.monotonic() + timeout
        while True:
            busy = machine_busy(1.0)
            if busy < max_busy or time.monotonic() > deadline:
                break
    polite_barrier(comm)
    return comm.bcast(busy)


def parser(description: str) -> argparse.ArgumentParser:
    """The options every benchmark takes; scripts add their own."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", default=None,
                   help="JSON output path (default: bench/results/<script>.json); "
                        "the PNG and Markdown go next to it")
    p.add_argument("--tiny", action="store_true",
                   help="a seconds-long smoke run (what the test suite uses)")
    p.add_argument("--no-plot", action="store_true", help="write no PNG")
    p.add_argument("--quiet-below", type=float, default=1.0, metavar="FRACTION",
                   help="before starting, wait up to --quiet-timeout s until the machine's "
                        "cores are less than this fraction busy (default 1: do not wait)")
    p.add_argument("--quiet-timeout", type=float, default=600)
    return p


def interleaved_median_times(fns: Dict[str, Callable[[], object]], iters: int, blocks: int = 4,
                             warmup: int = 1, comm=None) -> Dict[str, float]:
    """median_time of each of `fns`, measured in `blocks` rounds that run each fn for
    about iters / blocks runs (after `warmup` of its own), one fn after the other.

    Numbers to be compared are then taken within a fraction of a second of each
    other: this VM's speed moves by 10-30% over seconds, enough to flip a ratio
    measured as two runs one after the other.
    """
    per = max(1, -(-iters // blocks))
    times = {name: [] for name in fns}
    for _ in range(blocks):
        for name, fn in fns.items():
            times[name].append(_times(fn, per, warmup, comm))
    return {name: float(np.median(np.concatenate(t))) for name, t in times.items()}


def _times(fn: Callable[[], object], iters: int, warmup: int, comm,
           setup: Optional[Callable[[], object]] = None) -> np.ndarray:
    """The slowest rank's wall time of each of `iters` runs of fn, after `warmup` runs
    (setup, untimed, before each)."""
    times = np.empty(iters)
    for i in range(warmup + iters):
        if setup is not None:
            setup()
        if comm is not None:
            comm.Barrier()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        if i >= warmup:
            times[i - warmup] = dt
    if comm is not None and comm.Get_size() > 1:
        from mpi4py import MPI
        slowest = np.empty_like(times)
        comm.Allreduce(times, slowest, op=MPI.MAX)
        times = slowest
    return times


def median_time(fn: Callable[[], object], iters: int, warmup: int = 2, comm=None,
                setup: Optional[Callable[[], object]] = None) -> float:
    """Median over `iters` runs of fn of the slowest rank's wall time, in seconds.

    Ranks line up on a barrier before each run, so every run starts together
    and the slowest rank's time is the collective's time.
    """
    return float(np.median(_times(fn, iters, warmup, comm, setup)))


def busbw(nbytes: int, seconds: float, ranks: int) -> float:
    """Bus bandwidth in bytes/s: algbw x 2(n-1)/n (what each link carries in a ring)."""
    if seconds <= 0:
        return float("nan")
    algbw = nbytes / seconds
    return algbw * 2 * (ranks - 1) / ranks if ranks > 1 else algbw


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}"
        n /= 1024
    return str(n)


class Target:
    """One target of the issue: a measured value against a bound, met or not, and why not."""

    def __init__(self, name: str, value: Optional[float], bound: float, unit: str,
                 higher_is_better: bool, limited_by: str = ""):
        self.name = name
        self.value = value
        self.bound = bound
        self.unit = unit
        self.higher_is_better = higher_is_better
        if value is None or not np.isfinite(value):
            self.met = None
        else:
            self.met = bool(value >= bound if higher_is_better else value <= bound)
        self.limited_by = limited_by if self.met is False else ""

    def as_dict(self) -> dict:
        return {"name": self.name, "value": self.value, "bound": self.bound, "unit": self.unit,
                "comparison": ">=" if self.higher_is_better else "<=", "met": self.met,
                "limited_by": self.limited_by}


def horolite_run() -> str:
    """The horolite-run beside this Python (a driver that starts its own jobs)."""
    return shutil.which("horolite-run", path=os.path.dirname(sys.executable) + os.pathsep
                        + os.environ.get("PATH", ""))


def polite_barrier(comm, poll_seconds: float = 0.005) -> None:
    """A barrier that sleeps while it waits, so a waiting rank leaves its core free."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(poll_seconds)


@contextlib.contextmanager
def simulated_hosts(count: int, rate: str, script: str):
    """A bed of `count` simulated hosts (tests/multihost/bed.py; root only), every link at
    `rate` ('' or 'none': uncapped), closed on the way out. Where none can be built, the
    script ends with exit code 2, saying why."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "multihost"))
    from bed import Bed, unavailable_reason
    reason = unavailable_reason()
    if reason:
        print(f"{script}: cannot build simulated hosts: {reason}", file=sys.stderr)
        raise SystemExit(2)
    with Bed(count) as bed:
        if rate and rate != "none":
            bed.shape(rate)
        yield bed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """This environment without the MPI launcher's variables, so a child process is
    not mistaken for a rank of this job."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "MPI_", "HYDRA_", "OMPI_", "PRTE_", "MPIR_"))}
    env.update(extra or {})
    return env


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _uncommitted() -> List[str]:
    """horolite files that differ from the commit at run time (a shared checkout moves)."""
    try:
        out = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--", "horolite", "native"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line[3:] for line in out.splitlines() if line.strip()]


def _command(ranks: Optional[int]) -> str:
    """How the run was started (None: a driver that starts its own jobs)."""
    script = os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)
    launch = f"horolite-run -np {ranks} " if ranks is not None else ""
    return " ".join([f"{launch}python {script}", *sys.argv[1:]])


def _versions() -> Dict[str, str]:
    out = {"python": platform.python_version(), "numpy": np.__version__}
    for mod in ("mpi4py", "torch", "tensorflow"):
        m = sys.modules.get(mod)
        if m is not None:
            out[mod] = getattr(m, "__version__", "?")
    try:
        from mpi4py import MPI
        out["mpi"] = MPI.Get_library_version().splitlines()[0].strip()
    except Exception:  # noqa: BLE001 - informational only
        pass
    return out


def _markdown(columns: Sequence[str], rows: List[Sequence[str]], targets: List[Target]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    if targets:
        lines += ["", "| target | measured | bound | met | what limits it |", "|---|---|---|---|---|"]
        for t in targets:
            value = "n/a" if t.value is None else f"{t.value:.4g} {t.unit}".strip()
            bound = f"{'>=' if t.higher_is_better else '<='} {t.bound:g} {t.unit}".strip()
            met = {True: "met", False: "**missed**", None: "not measured"}[t.met]
            lines.append(f"| {t.name} | {value} | {bound} | {met} | {t.limited_by} |")
    return "\n".join(lines) + "\n"


def finish(comm, args, name: str, payload: dict, columns: Sequence[str],
           table: List[Sequence[str]], targets: List[Target],
           plot: Optional[Callable[[object], None]] = None) -> Optional[str]:
    """Every rank calls it; rank 0 writes JSON (+ Markdown, + PNG via plot(ax)) and
    prints the table. Returns the JSON path on rank 0, None elsewhere.

    The JSON records how busy the machine was with other processes during the
    run (all cores' busy time minus this job's own CPU time), since a shared
    machine skews every number.
    """
    t1, b1, own1 = _cpu_snapshot()
    t0, b0, own0 = _START
    own = comm.allreduce(own1 - own0) if comm is not None else own1 - own0
    ranks = comm.Get_size() if comm is not None else 1
    if comm is not None and comm.Get_rank() != 0:
        return None
    cores = os.cpu_count() or 1
    other = max(0.0, ((b1 - b0) - own) / ((t1 - t0) * cores))
    out = args.out or os.path.join(RESULTS, f"{name}{'_tiny' if args.tiny else ''}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    md = _markdown(columns, table, targets)
    doc = {
        "benchmark": name,
        "command": _command(ranks if comm is not None else None),
        "ranks": ranks,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": {"cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                 else os.cpu_count(), "machine": platform.machine()},
        "git_commit": _git_commit(),
        "uncommitted_runtime_files": _uncommitted(),
        "other_processes_busy_fraction": round(other, 3),
        "wall_seconds": round(t1 - t0, 1),
        "versions": _versions(),
        "settings": {k: v for k, v in os.environ.items() if k.startswith(("HOROLITE_", "HOROVOD_"))},
        **payload,
        "targets": [t.as_dict() for t in targets],
    }
    base = os.path.splitext(out)[0]
    # plots live beside the docs that show them (docs/images), the JSON beside the scripts
    png = (os.path.join(ROOT, "docs", "images", os.path.basename(base) + ".png")
           if args.out is None else base + ".png")
    doc["plot"] = None
    if plot is not None and not args.no_plot:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print(f"[{name}] matplotlib is not installed: no PNG written "
                  "(pip install matplotlib); the JSON is complete", flush=True)
        else:
            fig, ax = plt.subplots(figsize=(7.5, 4.5))
            plot(ax)
            ax.set_title(f"{name}: {ranks} ranks, {doc['host']['cores']} cores")
            ax.grid(True, which="both", alpha=0.3)
            fig.tight_layout()
            fig.savefig(png, dpi=110)
            plt.close(fig)
            doc["plot"] = os.path.basename(png)
    with open(out, "w") as f:
        json.dump(doc, f, indent=1, default=float)
        f.write("\n")
    with open(base + ".md", "w") as f:
        f.write(f"`{doc['command']}`\n\n" + md)
    print(f"\n{name}: {doc['command']}\n(other processes kept {100 * other:.0f}% of the "
          f"{cores} cores busy during the run)\n\n{md}\nwrote {out}"
          + (f" and {png}" if doc["plot"] else ""), flush=True)
    return out
