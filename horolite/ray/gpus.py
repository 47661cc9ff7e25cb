"""Which GPUs a Ray worker sees: all of its machine's workers' GPUs, in local-rank order.

Ray gives each actor only the GPUs it reserved (``CUDA_VISIBLE_DEVICES`` "0" on one,
"1" on the next). The usual pinning line, ``gpus[hvd.local_rank()]``, then fails on local
rank 1 and up, and NCCL cannot reach a peer GPU its process cannot see. As Horovod's
Ray strategy and Ray Train's ``share_cuda_visible_devices`` do, every worker of a machine
sees the GPUs of all of them; here in local-rank order, so that entry ``local_rank`` is
the worker's own (with one GPU per worker), and horolite's own choice
(``HOROLITE_GPU_DEVICE``, set when the local rank would not find it) picks its own too.
"""
from __future__ import annotations

import os
from typing import Dict, List, Mapping, Sequence

__all__ = ["shared_gpus", "user_picks_device"]


def user_picks_device(environ: Mapping[str, str] = os.environ) -> bool:
    """The driver's environment names the device itself (it is passed on as it is)."""
    return any(environ.get(p + "GPU_DEVICE", "").strip() for p in ("HOROLITE_", "HOROVOD_"))


def shared_gpus(own: Sequence[str], order: List[Sequence[str]], local_rank: int,
                pick: bool = True) -> Dict[str, str]:
    """The variables of a worker holding GPUs `own`, whose machine's workers hold
    `order` (each one's GPU ids, in local-rank order; `own` among them). `pick`: set
    HOROLITE_GPU_DEVICE where entry `local_rank` is not the worker's first GPU (always
    for `local_rank` -1: an elastic worker, whose local rank changes)."""
    if not own:
        return {}
    visible = list(dict.fromkeys(str(g) for ids in order for g in ids))
    env = {"CUDA_VISIBLE_DEVICES": ",".join(visible)}
    index = visible.index(str(own[0]))
    if pick and index != local_rank:
        env["HOROLITE_GPU_DEVICE"] = env["HOROVOD_GPU_DEVICE"] = str(index)
    return env
