"""Tensor fusion: pack consecutive small allreduces into one buffer.

Planning is a pure function of the (identical) response list and the tensor
sizes, so every rank fuses the same way without talking about it.
"""
from __future__ import annotations

from typing import Callable, List, Sequence

import numpy as np

from .messages import Kind, Response

__all__ = ["plan_batches", "FusionBuffer"]


def _fusion_key(resp: Response):
    # Cached on the response: cached responses come back every step.
    key = resp.__dict__.get("_fusion_key")
    if key is None:
        key = resp.__dict__["_fusion_key"] = (resp.dtype, resp.op, resp.prescale, resp.postscale,
                                              resp.device, resp.joined)
    return key


def plan_batches(responses: Sequence[Response], nbytes: Callable[[Response], int],
                 threshold: int) -> List[List[Response]]:
    """Group consecutive fusable allreduces whose total stays within `threshold` bytes.

    Everything else (errors, other collectives, tensors bigger than the
    threshold, or all tensors when threshold is 0) runs alone.
    """
    batches: List[List[Response]] = []
    current: List[Response] = []
    current_bytes = 0
    for resp in responses:
        size = nbytes(resp) if resp.kind == Kind.ALLREDUCE and resp.error is None else -1
        fusable = 0 <= size <= threshold and threshold > 0
        if (current and fusable and _fusion_key(current[0]) == _fusion_key(resp)
                and current_bytes + size <= threshold):
            current.append(resp)
            current_bytes += size
            continue
        if current:
            batches.append(current)
        current, current_bytes = ([resp], size) if fusable else ([], 0)
        if not fusable:
            batches.append([resp])
    if current:
        batches.append(current)
    return batches


class FusionBuffer:
    """One byte buffer, allocated at the first fused batch and reused after."""

    def __init__(self, threshold: int):
        self.threshold = threshold
        self._buffer = None

    def get(self, nbytes: int) -> np.ndarray:
        if self._buffer is None or self._buffer.nbytes < nbytes:
            self._buffer = np.empty(max(self.threshold, nbytes), dtype=np.uint8)
        return self._buffer[:nbytes]
