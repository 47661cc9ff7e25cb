"""Jobs without MPI as schedulers start them, timed on this host (issue 71's targets):

* torchrun: a 2-rank job with torchrun's variables and a listener on MASTER_PORT (its
  agent's store) against the same job on a free port without torchrun: init() after the
  last rank's process started, the difference (target: within 1 s);
* a duplicate: ranks 0 and 1, then a second rank 1: from the duplicate's call to init()
  to the last rank's error naming it (target: 1 s);
* a squatted Slurm port: a 2-task Slurm-style job whose first derived port is held by a
  listener that never speaks, against the same job with the port free (target: 2 s more);
* 1,000 trickling strangers: at the rendezvous a rank-0 process serves (one byte each
  second, never a whole hello): its threads and descriptors at their peak and one hello
  deadline later, and a client's put and get meanwhile against before; then a 2-rank job
  started while 1,000 strangers hammer its rendezvous port, against one without.

    python bench/world_start.py [--rounds 3] [--strangers 1000]

Prints a Markdown table: each measure, its value, the target and met/missed.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
LEAKS = ("PMI_", "OMPI_", "PMIX_", "HYDRA_", "MPI_LOCAL", "SLURM_", "HOROLITE_", "HOROVOD_",
         "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "PET_", "TF_CONFIG", "TORCHELASTIC_")
KEY = os.urandom(32).hex()
RANK = """
import json, sys, time
born = time.time()
import horolite as hvd
called = time.time()
try:
    hvd.init()
    print(json.dumps({"born": born, "called": called, "ready": time.time()}))
except Exception as e:
    print(json.dumps({"born": born, "called": called, "failed": time.time(), "error": str(e)}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**extra) -> dict:
    out = {k: v for k, v in os.environ.items() if not k.startswith(LEAKS)}
    out.update(HOROLITE_JOB_KEY=KEY, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3",
               HOROLITE_GLOO_TIMEOUT_SECONDS="30")
    out.update(extra)
    return out


def start(envs):
    return [subprocess.Popen([sys.executable, "-c", RANK], env=e, cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) for e in envs]


def results(procs):
    out = []
    for p in procs:
        text, _ = p.communicate(timeout=120)
        out.append(json.loads(text.strip().splitlines()[-1]))
    return out


def setup_seconds(envs) -> float:
    """init() returns on the last rank, after the last rank's process started."""
    got = results(start(envs))
    assert all("ready" in r for r in got), got
    return max(r["ready"] for r in got) - max(r["born"] for r in got)


def torchrun_envs(port, torchrun: bool):
    extra = {"TORCHELASTIC_RUN_ID": "bench"} if torchrun else {}
    return [env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **extra) for r in range(2)]


def torchrun_case(rounds: int):
    free, beside = [], []
    for _ in range(rounds):
        free.append(setup_seconds(torchrun_envs(free_port(), False)))
        with socket.create_server(("127.0.0.1", 0)) as agent_store:
            beside.append(setup_seconds(torchrun_envs(agent_store.getsockname()[1], True)))
    return statistics.median(free), statistics.median(beside)


def duplicate_case(rounds: int):
    took = []
    for _ in range(rounds):
        port = free_port()
        envs = [env(RANK=str(r), WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                    HOROLITE_HOSTNAME=f"node{i}") for i, r in enumerate((0, 1, 1))]
        procs = start(envs[:2])
        time.sleep(3.0)  # (the first two wait at the rendezvous)
        procs += start(envs[2:])
        got = results(procs)
        assert all("claimed by two processes" in r.get("error", "") for r in got), got
        took.append(max(r["failed"] for r in got) - got[2]["called"])
    return statistics.median(took)


def slurm_envs(job: str):
    base = dict(SLURM_NTASKS="2", SLURM_TASKS_PER_NODE="2", SLURM_JOB_NODELIST="localhost",
                SLURM_JOB_ID=job, SLURM_STEP_ID="0")
    return base, [env(SLURM_PROCID=str(r), SLURM_LOCALID=str(r), **base) for r in range(2)]


def slurm_case(rounds: int):
    from horolite.world.identity import slurm_port
    free, squatted = [], []
    for i in range(rounds):
        base, envs = slurm_envs(f"{os.getpid()}{i}")
        free.append(setup_seconds(envs))
        base, envs = slurm_envs(f"{os.getpid()}{i}9")
        with socket.create_server(("127.0.0.1", slurm_port(base))):  # (accepts, never speaks)
            squatted.append(setup_seconds(envs))
    return statistics.median(free), statistics.median(squatted)


STRANGERS = """
import socket, sys, time
port, n, until = int(sys.argv[1]), int(sys.argv[2]), time.time() + float(sys.argv[3])
open_ = []
while time.time() < until:
    while len(open_) < n:
        try:
            open_.append(socket.create_connection(("127.0.0.1", port), timeout=1))
        except OSError:
            time.sleep(0.05)
            break
    for s in list(open_):
        try:
            s.send(b"x")
        except OSError:
            open_.remove(s)
            s.close()
    time.sleep(1.0)
"""


def strangers(port: int, n: int, seconds: float):
    return subprocess.Popen([sys.executable, "-c", STRANGERS, str(port), str(n), str(seconds)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def resources():
    return threading.active_count(), len(os.listdir("/proc/self/fd"))


def client_seconds(port: int) -> float:
    from horolite.world.rendezvous import RendezvousClient
    begun = time.monotonic()
    with RendezvousClient("127.0.0.1", port, bytes.fromhex(KEY), timeout=30) as c:
        c.put("bench", "k", b"v")
        c.get("bench", "k", 0)
    return time.monotonic() - begun


def strangers_at_the_server(n: int):
    from horolite.world.rendezvous import HELLO_SECONDS, RendezvousServer
    with RendezvousServer(bytes.fromhex(KEY), "127.0.0.1", 0) as server:
        base = resources()
        quiet = statistics.median(client_seconds(server.port) for _ in range(5))
        crowd = strangers(server.port, n, 3 * HELLO_SECONDS)
        peak, busy = base, []
        began = time.monotonic()
        while time.monotonic() - began < HELLO_SECONDS:
            now = resources()
            peak = (max(peak[0], now[0]), max(peak[1], now[1]))
            busy.append(client_seconds(server.port))
            time.sleep(0.2)
        during = resources()
        crowd.kill()
        crowd.wait()
        time.sleep(HELLO_SECONDS + 1.0)
        after = resources()
        return base, peak, during, after, quiet, statistics.median(busy), max(busy), server.dropped


def job_with_strangers(n: int, rounds: int):
    quiet, crowded = [], []
    for _ in range(rounds):
        quiet.append(setup_seconds(torchrun_envs(free_port(), False)))
        port = free_port()
        crowd = strangers(port, n, 60)
        time.sleep(1.0)
        try:
            crowded.append(setup_seconds(torchrun_envs(port, False)))
        finally:
            crowd.kill()
            crowd.wait()
    return statistics.median(quiet), statistics.median(crowded)


def row(measure, value, target, met):
    print(f"| {measure} | {value} | {target} | {'met' if met else '**missed**'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--strangers", type=int, default=1000)
    args = parser.parse_args()
    os.environ.pop("HOROLITE_JOB_KEY", None)
    print(f"rounds {args.rounds}, load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs\n")
    print("| measure | value | target | met |\n|---|---|---|---|")
    free, beside = torchrun_case(args.rounds)
    row("torchrun (agent's store on MASTER_PORT) against a free port: init() after the last "
        "start", f"{beside:.2f} s against {free:.2f} s ({beside - free:+.2f} s)", "within 1 s",
        beside - free <= 1.0)
    dup = duplicate_case(args.rounds)
    row("a rank claimed twice: the duplicate's init() call to the last rank's error",
        f"{dup:.2f} s", "<= 1 s", dup <= 1.0)
    free, squatted = slurm_case(args.rounds)
    row("Slurm, first derived port squatted (silent): init() after the last start",
        f"{squatted:.2f} s against {free:.2f} s ({squatted - free:+.2f} s)", "<= 2 s more",
        squatted - free <= 2.0)
    base, peak, during, after, quiet, busy, worst, dropped = strangers_at_the_server(
        args.strangers)
    row(f"{args.strangers} trickling strangers at a rendezvous: threads / descriptors "
        "(before, peak, one hello deadline after they stop)",
        f"{base[0]}/{base[1]}, {peak[0]}/{peak[1]}, {after[0]}/{after[1]} "
        f"({dropped} dropped)", "back to before", after == base)
    row("a client's connect, put and get among them (median, worst) against alone",
        f"{busy * 1e3:.1f} ms, {worst * 1e3:.0f} ms against {quiet * 1e3:.1f} ms",
        "unaffected (within 0.5 s)", worst - quiet <= 0.5)
    quiet_job, crowded_job = job_with_strangers(args.strangers, args.rounds)
    row(f"a 2-rank job started among {args.strangers} strangers at its rendezvous port: "
        "init() after the last start", f"{crowded_job:.2f} s against {quiet_job:.2f} s "
        f"({crowded_job - quiet_job:+.2f} s)", "unaffected (within 0.5 s)",
        crowded_job - quiet_job <= 0.5)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory():
        main()
