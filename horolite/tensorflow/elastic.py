"""`hvd.elastic` (Horovod's elastic training): not supported.

A horolite job is a fixed MPI job: ranks cannot join or leave. Any name of
Horovod's `horovod.tensorflow.elastic` raises NotImplementedError saying so, so
that code written for it fails at once instead of training without elasticity.
"""

_WHY = ("horolite has no elastic training (a job is a fixed set of MPI ranks); "
        "use a plain training loop with checkpoints, and restart the job to change its size")


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    raise NotImplementedError(f"hvd.elastic.{name}: {_WHY}")
