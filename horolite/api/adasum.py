"""Horovod's rules for op=Adasum in the NumPy API, checked on the caller's thread on every
rank alike (the number of ranks and the set are the same everywhere, so every rank
refuses together and none waits for the others). The reduction itself is
transport/adasum.py."""
from __future__ import annotations

from ..core.ops import dtype_name
from ..errors import AdasumUnsupportedError, InvalidCollectiveError
from ..transport.adasum import ADASUM_DTYPES, is_power_of_two

__all__ = ["check_adasum"]


def check_adasum(arr, name: str, rt) -> None:
    """Horovod's Adasum rules, on every rank alike (so none waits for the others): float
    tensors, a power-of-two number of ranks, the global process set."""
    dname = dtype_name(arr.dtype)
    if dname not in ADASUM_DTYPES:
        raise InvalidCollectiveError(f"tensor '{name}': Adasum reduces {', '.join(ADASUM_DTYPES)}, "
                                     f"not {dname}")
    if rt.set_label:
        raise AdasumUnsupportedError(f"tensor '{name}': Adasum runs over the global process set "
                                     f"only (as in Horovod), not {rt.set_label}")
    if not is_power_of_two(rt.size):
        raise AdasumUnsupportedError(f"tensor '{name}': Adasum needs a power-of-two number of "
                                     f"ranks (1, 2, 4, 8...), and this job has {rt.size}")
