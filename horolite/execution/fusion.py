"""Tensor fusion: pack consecutive small allreduces into one buffer.

Planning is a pure function of the (identical) response list and the tensor
sizes, so every rank fuses the same way without talking about it.
"""
from __future__ import annotations

from typing import Callable, List, Sequence, Tuple

from ..core.messages import Kind, Response

__all__ = ["plan_spans"]


def _fusion_key(resp: Response):
    # Cached on the response: cached responses come back every step.
    key = resp.__dict__.get("_fusion_key")
    if key is None:
        key = resp.__dict__["_fusion_key"] = (resp.dtype, resp.op, resp.prescale, resp.postscale,
                                              resp.device, resp.joined)
    return key


def plan_spans(responses: Sequence[Response], nbytes: Callable[[Response], int],
               threshold: int) -> List[Tuple[int, int]]:
    """Batches as [start, stop) ranges of `responses`: consecutive fusable allreduces
    whose total stays within `threshold` bytes share one.

    Everything else (errors, other collectives, tensors bigger than the
    threshold, or all tensors when threshold is 0) runs alone.
    """
    spans: List[Tuple[int, int]] = []
    start, key, current_bytes = -1, None, 0  # the open batch, if start >= 0
    for i, resp in enumerate(responses):
        # (a quorum allreduce runs alone: its contributors are its own)
        size = (nbytes(resp) if resp.kind == Kind.ALLREDUCE and resp.error is None
                and not resp.contributors else -1)
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
