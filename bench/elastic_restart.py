"""Elastic restart: time from a kill -9 of a rank to the next completed training step.

Runs tests/launcher_rank/elastic_tf.py (TensorFlowState, DistributedGradientTape) under
``horolite-run --min-np``, kills one rank's process (over ssh when it is on another
host) after --kill-at steps, and splits the time until the restarted job completes its
first step into: the driver seeing the failure and restarting (the old job's end,
blacklisting), the new processes starting (Python, TensorFlow's import, hvd.init()),
resuming (the newest commit broadcast and restored, then state.sync()), and the first
step (tf.function tracing included). On the multi-host bed:

    flock /tmp/horolite-bed.lock python tests/multihost/bed.py --hosts 3 -- \
        python bench/elastic_restart.py --hosts hl-a:1,hl-b:1,hl-c:1 --kill-rank 1
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TF_TRAIN = os.path.join(ROOT, "tests", "launcher_rank", "elastic_tf.py")
HOROLITE_RUN = os.path.join(os.path.dirname(sys.executable), "horolite-run")


def _wait_file(path, job, seconds):
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        if job.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"gave up waiting for {path}")
        time.sleep(0.02)


def _lines(path):
    try:
        with open(path) as f:
            return f.read().splitlines()
    except OSError:
        return []


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", default="localhost:2", help="-H of the job")
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--kill-at", type=int, default=12, help="steps done before the kill")
    p.add_argument("--cooldown", type=int, default=1, help="--blacklist-cooldown-range N N "
                                                           "(0: none)")
    p.add_argument("--json", help="also write the numbers here")
    args = p.parse_args(argv)
    hosts = [(h.rsplit(":", 1)[0], int(h.rsplit(":", 1)[1])) for h in args.hosts.split(",")]
    names = [h for h, n in hosts for _ in range(n)]
    out = tempfile.mkdtemp(prefix="horolite-elastic-bench-")
    argv = [HOROLITE_RUN, "-H", args.hosts, "--min-np", "1"]
    if args.cooldown:
        argv += ["--blacklist-cooldown-range", str(args.cooldown), str(args.cooldown)]
    argv += [sys.executable, TF_TRAIN, out, "--mode", "tape", "--steps", "200",
             "--commit-every", "5", "--sleep", "0.05"]
    job = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    restart_at = []

    def read_stderr():
        for line in job.stderr:
            if "elastic: generation 1:" in line:
                restart_at.append(time.time())
            if "elastic" in line:
                sys.stderr.write(line)
    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    _wait_file(os.path.join(out, f"steps.0.{args.kill_rank}"), job, 600)
    while len(_lines(os.path.join(out, "steps.0.0"))) < args.kill_at:
        time.sleep(0.01)
    with open(os.path.join(out, f"pid.0.{args.kill_rank}")) as f:
        pid = f.read().strip()
    host = names[args.kill_rank]
    killed = time.time()
    if host in ("localhost", "127.0.0.1"):
        os.kill(int(pid), signal.SIGKILL)
    else:
        subprocess.run(["ssh", host, "kill", "-9", pid], check=True, timeout=30)
    _wait_file(os.path.join(out, "steps.1.0"), job, 600)
    while not _lines(os.path.join(out, "steps.1.0")):
        time.sleep(0.01)
    first_step = float(_lines(os.path.join(out, "steps.1.0"))[0].split()[4])
    started = os.path.getmtime(os.path.join(out, "pid.1.0"))
    resumed = os.path.getmtime(os.path.join(out, "resumed.1.0"))
    job.send_signal(signal.SIGINT)
    job.wait(timeout=60)
    reader.join(timeout=5)
    parts = {
        "kill_to_restart_s": restart_at[0] - killed if restart_at else float("nan"),
        "process_start_import_init_s": started - (restart_at[0] if restart_at else killed),
        "resume_and_sync_s": resumed - started,
        "first_step_s": first_step - resumed,
        "kill_to_next_step_s": first_step - killed,
    }
    print(f"kill -9 of rank {args.kill_rank} on {host} ({args.hosts}, cooldown "
          f"{args.cooldown} s) to the next completed step: {parts['kill_to_next_step_s']:.1f} s")
    for name, value in parts.items():
        print(f"  {name:30s} {value:6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(parts, hosts=args.hosts, kill_rank=args.kill_rank,
                           load_average=os.getloadavg()[0]), f, indent=1)


if __name__ == "__main__":
    main()
