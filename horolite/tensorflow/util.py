"""Horovod's ``horovod.tensorflow.util``: the small helpers its tests and some user code
import from there (eager or not, a tf.function, variables as dictionary keys), and the
few of ``horovod.common.util`` that ``horovod.tensorflow`` re-exports."""
from __future__ import annotations

import tensorflow as tf

__all__ = ["_executing_eagerly", "_make_subgraph", "_cache", "vars_to_refs", "refs_to_vars",
           "gpu_available", "check_num_rank_power_of_2", "split_list"]


def _executing_eagerly() -> bool:
    """Whether ops run eagerly here (False inside a tf.function or a TF1 graph)."""
    return tf.executing_eagerly()


def _make_subgraph(f):
    return tf.function(f)


def _cache(f):
    """Memoize `f` by its arguments and by whether it is called eagerly (a graph's
    tensors cannot be reused eagerly, nor the other way)."""
    cache = {}

    def wrapper(*args):
        key = (args, _executing_eagerly())
        if key not in cache:
            cache[key] = f(*args)
        return cache[key]
    return wrapper


def vars_to_refs(variables):
    """Hashable references of a variable or of a (nested) list of them."""
    if isinstance(variables, list):
        return tuple(vars_to_refs(v) for v in variables)
    return variables.ref()


def refs_to_vars(refs):
    """The inverse of vars_to_refs."""
    if isinstance(refs, tuple):
        return [refs_to_vars(r) for r in refs]
    return refs.deref()


def gpu_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Horovod's: whether the framework `ext_base_name` runs with a GPU here. Only
    "tensorflow" is horolite's; any other name is False (Horovod: not installed)."""
    if ext_base_name != "tensorflow":
        return False
    return bool(tf.config.list_physical_devices("GPU"))


def check_num_rank_power_of_2(num_rank: int) -> bool:
    """Whether `num_rank` is a power of two (Horovod's test for Adasum)."""
    return num_rank != 0 and (num_rank & (num_rank - 1)) == 0


def split_list(items, n: int) -> list:
    """`items` in `n` near-even consecutive chunks (the first ones one longer)."""
    d, r = divmod(len(items), n)
    return [items[i * d + min(i, r):(i + 1) * d + min(i + 1, r)] for i in range(n)]
