"""A RayExecutor job on a Ray cluster across simulated hosts (run on hl-a by
test_multihost_ray.py): 2 hosts x 2 workers, the collectives, then the last rank's worker dies. Writes what it saw as JSON to argv[1]."""
import json
import os
import signal
import sys
import time

import numpy as np
import ray

from horolite.errors import HorovodInternalError
from horolite.ray import RayExecutor


def collectives():
    import socket
    import horolite as hvd
    hvd.init()
    r = hvd.rank()
    x = np.random.default_rng(50 + r).standard_normal(1000)
    return {"rank": r, "size": hvd.size(), "local_rank": hvd.local_rank(),
            "local_size": hvd.local_size(), "host": socket.gethostname(),
            "sum": hvd.allreduce(x, op=hvd.Sum, name="sum").tolist(),
            "gathered": hvd.allgather(np.full(2, float(r)), name="gather").tolist()}


def the_last_rank_dies():
    import socket
    import horolite as hvd
    hvd.init()
    for step in range(100000):
        if step == 20 and hvd.rank() == hvd.size() - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        hvd.allreduce(np.ones(64), name="grad")
        time.sleep(0.01)
    return socket.gethostname()


def main():
    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_hosts=2,
                           num_workers_per_host=2)
    executor.start()
    out = {"collectives": executor.run(collectives)}
    try:
        executor.run(the_last_rank_dies)
        out["died"] = None
    except HorovodInternalError as e:
        out["died"] = str(e)
        out["cause"] = type(e.__cause__).__name__
    out["placed"] = [p.node.label() for p in executor.placed]
    executor.shutdown()
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
