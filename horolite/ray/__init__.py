"""horolite on Ray: Horovod's ``RayExecutor`` and a Ray Train backend.

    from horolite.ray import RayExecutor
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=4)
    executor.start()
    losses = executor.run(train)          # train() calls hvd.init() as under horolite-run
    executor.shutdown()

or, under Ray Train::

    DataParallelTrainer(train_loop, backend_config=horolite.ray.HorovodConfig(),
                        scaling_config=ScalingConfig(num_workers=4)).fit()

The workers are Ray actors; they meet at a rendezvous that a small actor of the job
serves, and then talk over horolite's own connections (no MPI).
"""
try:
    import ray  # noqa: F401  (here, for the message below)
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("horolite.ray needs Ray, which is not installed: "
                      'pip install "horolite[ray]"') from e

from . import ray_logger
from .executor import MiniSettings, RayExecutor

__all__ = ["RayExecutor", "MiniSettings", "HorovodConfig", "ray_logger"]


def __getattr__(name):
    # Ray Train (and pandas with it) loads only for those who use it: a worker actor
    # that imports this package starts a second sooner without it.
    if name == "HorovodConfig":
        from .train import HorovodConfig
        return HorovodConfig
    raise AttributeError(f"module 'horolite.ray' has no attribute {name!r}")
