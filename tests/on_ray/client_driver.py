"""A driver outside the cluster, as Ray Client users (``ray://``, KubeRay's port-forward)
run one: an elastic RayExecutor of 2 workers sums each rank's rank + 1. Prints the sums.

    python client_driver.py ray://127.0.0.1:PORT
"""
import sys

import ray

from horolite.ray import RayExecutor


def summed():
    import numpy as np
    import horolite as hvd
    hvd.init()
    return float(hvd.allreduce(np.array([hvd.rank() + 1.0]), name="client", op=hvd.Sum)[0])


if __name__ == "__main__":
    ray.init(sys.argv[1])
    assert ray.util.client.ray.is_connected()  # (a Ray Client, not a driver on a node)
    from horolite.world import rendezvous

    def not_here(*args, **kwargs):
        raise AssertionError("a rendezvous served in the Ray Client driver")
    rendezvous.RendezvousServer = not_here  # (its workers may not reach this process)
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), min_workers=2,
                           max_workers=2)
    executor.start()
    try:
        print("sums", executor.run(summed), flush=True)
    finally:
        executor.shutdown()
