"""Python objects across ranks: what Horovod's `broadcast_object` does for PyTorch and
TensorFlow, for any job (an elastic `ObjectState` needs one as its `bcast_object`)."""
from __future__ import annotations

import pickle
from typing import Any, Optional

import numpy as np

from . import basics
from .collectives import broadcast
from .process_sets import global_process_set

__all__ = ["broadcast_object"]


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set=global_process_set) -> Any:
    """`obj` as root_rank has it, on every rank: pickled there, unpickled here (the
    ranks of one job trust each other's pickles, as Horovod's do). Collective."""
    name = name or "broadcast_object"
    if basics.rank() == root_rank:  # (root_rank is a job rank, on a process set too)
        payload = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        length = np.array([payload.size], np.int64)
    else:
        payload, length = None, np.zeros(1, np.int64)
    length = broadcast(length, root_rank, name=f"{name}.length", process_set=process_set)
    if payload is None:
        payload = np.zeros(int(length[0]), np.uint8)
    data = broadcast(payload, root_rank, name=f"{name}.data", process_set=process_set)
    return pickle.loads(data.tobytes())
