"""What one rank runs in the ``horolite-run --gloo`` tests (launcher alone, no horolite.init).

It meets the other ranks at the launcher's rendezvous with the job's key from its
environment, then leaves a mark file ``<outdir>/rank.<rank>`` (JSON): the variables
the launcher set, its host, what every rank put, and the pids on this host whose
command line holds the key (there must be none). Then it fails as asked, or sleeps.
"""
import argparse
import json
import os
import signal
import socket
import sys
import time

from horolite.world.rendezvous import RendezvousClient

PREFIXES = ("HOROLITE_", "HOROVOD_")


def pids_with_key_on_cmdline(key_hex):
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if key_hex.encode() in f.read():
                    found.append(int(entry))
        except OSError:
            pass
    return found


def main():
    p = argparse.ArgumentParser()
    p.add_argument("outdir")
    p.add_argument("--fail-rank", type=int, default=None)
    p.add_argument("--fail-how", choices=("exit", "kill"), default="exit")
    p.add_argument("--fail-code", type=int, default=3)
    p.add_argument("--sleep", type=float, default=0.0, help="then sleep (to be stopped)")
    args = p.parse_args()
    env = os.environ
    rank, size = int(env["HOROLITE_RANK"]), int(env["HOROLITE_SIZE"])
    client = RendezvousClient(env["HOROLITE_RENDEZVOUS_ADDR"],
                              int(env["HOROLITE_RENDEZVOUS_PORT"]),
                              bytes.fromhex(env["HOROLITE_JOB_KEY"]),
                              float(env["HOROLITE_GLOO_TIMEOUT_SECONDS"]))
    try:
        client.put("probe", str(rank), socket.gethostname().encode())
        everyone = client.wait_all("probe", [str(r) for r in range(size)],
                                   float(env["HOROLITE_GLOO_TIMEOUT_SECONDS"]))
    finally:
        client.close()
    mark = {"rank": rank, "size": size, "host": socket.gethostname(), "pid": os.getpid(),
            "cwd": os.getcwd(), "peers": {k: v.decode() for k, v in everyone.items()},
            "env": {k: v for k, v in env.items() if k.startswith(PREFIXES)},
            "passed": {k: env.get(k) for k in ("PROBE_PASSED", "PROBE_SET", "PROBE_GLOBAL")},
            "key_on_cmdline": pids_with_key_on_cmdline(env["HOROLITE_JOB_KEY"])}
    path = os.path.join(args.outdir, f"rank.{rank}")
    with open(path + ".tmp", "w") as f:
        json.dump(mark, f)
    os.rename(path + ".tmp", path)
    print(f"rank {rank} of {size} met {len(everyone)}", flush=True)
    if rank == args.fail_rank:
        time.sleep(0.3)
        if args.fail_how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        sys.exit(args.fail_code)
    time.sleep(args.sleep)


if __name__ == "__main__":
    main()
