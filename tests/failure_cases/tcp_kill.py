"""One rank's side of tests/test_failures_over_tcp.py: ranks on pretend hosts reduce
over horolite's TCP connections until one of them dies.

    python tcp_kill.py OUTDIR VICTIM CASE

CASE "kill9": rank VICTIM kills itself with SIGKILL at step 5; "kill9-forked": it first
forks a child that sleeps on (holding whatever the parent left it); "raise": it raises.
Every other rank writes what it caught to OUTDIR/rank.<N> (JSON: the error's text and
the rank it names as the failure's origin) before the error ends it.
"""
import json
import os
import signal
import sys
import time

import numpy as np

import horolite as hvd

OUTDIR, VICTIM, CASE = sys.argv[1], int(sys.argv[2]), sys.argv[3]
hvd.init()
RANK = hvd.rank()

try:
    for step in range(3000):
        if RANK == VICTIM and step == 5:
            with open(os.path.join(OUTDIR, "dies"), "w") as f:
                f.write(repr(time.time()))
            if CASE == "raise":
                raise RuntimeError("bad batch")
            if CASE == "kill9-forked" and os.fork() == 0:
                # A worker that outlives its parent (the OOM killer took the parent, say),
                # until the others have reported or 20 s have passed.
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline and \
                        len([n for n in os.listdir(OUTDIR) if n.startswith("rank.")]) < \
                        hvd.size() - 1:
                    time.sleep(0.05)
                os._exit(0)
            os.kill(os.getpid(), signal.SIGKILL)
        hvd.allreduce(np.full(1 << 12, float(step)), name="grad")
        time.sleep(0.002)
    result = {"finished": True}
except hvd.HorovodInternalError as e:
    result = {"at": time.time(), "text": str(e), "peer": getattr(e, "horolite_peer", None)}
    raise
finally:
    if RANK != VICTIM:
        with open(os.path.join(OUTDIR, f"rank.{RANK}"), "w") as f:
            json.dump(result, f)
