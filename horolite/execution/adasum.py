"""Runs an agreed batch of Adasum allreduces (host arrays): pack, reduce pairwise
(transport/adasum.py), scale, hand out each tensor's view of the result.

Adasum goes over MPI point-to-point whatever the host layout (one host or several):
its pairs exchange whole vectors, which the shared-memory and ring paths, built for
sums, do not do. The arguments were checked when the tensors were submitted (dtype,
a power-of-two number of ranks, the global set), so every rank gets here together.
"""
from __future__ import annotations

import math
import time
from typing import List, Optional

import numpy as np

from ..core import kernels
from ..core.handle import Handle
from ..core.messages import Response
from ..transport.adasum import adasum_allreduce

__all__ = ["run_adasum"]


def run_adasum(executor, batch: List[Response], entries: List[Optional[object]]) -> int:
    """Reduce `batch` (one dtype, fused or a single tensor) and complete its handles;
    each result is a view of one reduced buffer. Returns the bytes reduced."""
    first = batch[0]
    dtype = np.dtype(first.dtype)
    counts = [math.prod(r.shape) for r in batch]
    inputs = []
    for resp, entry in zip(batch, entries):
        if entry is None:  # a joined rank: zeros stand in (they leave the others unchanged)
            inputs.append(np.zeros(math.prod(resp.shape), dtype))
        elif entry.parts is not None:
            inputs.extend(entry.parts)
        else:
            inputs.append(entry.array.reshape(-1))
    start = time.monotonic()
    flat = executor.outputs.empty((sum(counts),), dtype)
    kernels.pack_into(flat, inputs, first.prescale)
    what = (f"tensor '{first.name}'" if len(batch) == 1 else
            f"tensor '{first.name}' and {len(batch) - 1} more fused with it")
    executor.transport.doing(f"{what} (Adasum)")
    adasum_allreduce(executor.transport.link, flat, counts)
    if first.postscale != 1.0:
        kernels.scale_into(flat, flat, first.postscale)  # as every op's postscale (float16 in float32)
    if executor.timeline.enabled:
        for resp in batch:
            executor.timeline.span(resp.name, "ADASUM_ALLREDUCE", start, time.monotonic())
    views, offset = [], 0
    for resp, n in zip(batch, counts):
        views.append(flat[offset:offset + n].reshape(resp.shape))
        offset += n
    done = [(r.name, e.handle, v) for r, e, v in zip(batch, entries, views) if e is not None]
    executor.queue.finish_all([name for name, _, _ in done])
    Handle.set_results([h for _, h, _ in done], [v for _, _, v in done])
    if len(batch) > 1:
        executor.fused_batches += 1
        executor.fused_tensors += len(batch)
    return flat.nbytes
