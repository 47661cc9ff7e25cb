"""Tensor fusion: pack consecutive small allreduces into one buffer.

Planning is a pure function of the (identical) response list and the tensor
sizes, so every rank fuses the same way without talking about it.
"""
from __future__ import annotations

from typing import Callable, List, Sequence, Tuple

from ..core.messages import Kind, Response

__all__ = ["plan_spans"]


# On the GPU these fuse too: one pack launch and one NCCL call for the batch
# (execution/device_executor.py); on the host each runs alone.
_DEVICE_FUSED = (Kind.ALLGATHER, Kind.BROADCAST, Kind.REDUCESCATTER)


def _fusion_key(resp: Response):
    # Cached on the response: cached responses come back every step.
    key = resp.__dict__.get("_fusion_key")
    if key is None:
        key = resp.__dict__["_fusion_key"] = (resp.kind, resp.dtype, resp.op, resp.prescale,
                                              resp.postscale, resp.device, resp.joined, resp.root)
    return key


def _fusable(resp: Response) -> bool:
    if resp.error is not None or resp.contributors:  # (a quorum allreduce runs alone)
        return False
    return resp.kind == Kind.ALLREDUCE or (resp.kind in _DEVICE_FUSED and resp.device != "cpu"
                                           and not resp.joined)


def plan_spans(responses: Sequence[Response], nbytes: Callable[[Response], int],
               threshold: int) -> List[Tuple[int, int]]:
    """Batches as [start, stop) ranges of `responses`: consecutive fusable allreduces (and,
    on the GPU, allgathers, broadcasts from one root, reducescatters) with the same key,
    whose total stays within `threshold` bytes, share one.

    Everything else (errors, other collectives, tensors bigger than the
    threshold, or all tensors when threshold is 0) runs alone.
    """
    spans: List[Tuple[int, int]] = []
    start, key, current_bytes = -1, None, 0  # the open batch, if start >= 0
    for i, resp in enumerate(responses):
        size = nbytes(resp) if _fusable(resp) else -1
        fusable = 0 <= size <= threshold and threshold > 0
        if fusable and start >= 0 and current_bytes + size <= threshold:
            k = _fusion_key(resp)
            if k == key:
                current_bytes += size
                continue
        if start >= 0:
            spans.append((start, i))
        if fusable:
            start, key, current_bytes = i, _fusion_key(resp), size
        else:
            start = -1
            spans.append((i, i + 1))
    if start >= 0:
        spans.append((start, len(responses)))
    return spans
