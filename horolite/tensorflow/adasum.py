"""Horovod's rules for op=Adasum in the TensorFlow API: its NotImplementedErrors, raised
before any op is built (so eagerly, in tf.function and in graphs alike)."""
from __future__ import annotations

import horolite as _core

__all__ = ["check_adasum"]


def check_adasum(process_set) -> None:
    """Horovod's NotImplementedErrors for Adasum, raised before any op exists (the class
    exactly, so a tf.function re-raises it as it is): a process set other than the global
    one, a number of ranks that is not a power of two."""
    if getattr(process_set, "process_set_id", 0) != 0:
        raise NotImplementedError(f"Adasum does not support non-global process sets yet "
                                  f"(got {process_set})")
    n = _core.size()
    if n & (n - 1):
        raise NotImplementedError(f"Running Adasum with non-power of 2 ranks is not supported "
                                  f"yet: this job has {n} ranks (1, 2, 4, 8... can run it)")
