"""The background thread's own time per member of a fused batch: device against host.

Runs without a GPU. One batch of a model's gradients (bench/step_models.py) goes
through the executor's entry point twice in the same process, interleaved: as host
arrays (NumPy; the transport reads the members where they lie and moves no byte)
and as device arrays (CuPy arrays over fake device addresses; the gather launch, its
table upload and NCCL are replaced by calls that do nothing, so what is timed is the
Python: pointer table, layout, views, completion). Bytes move in neither, so the
figures are the per-member work of each path. Target (issue 39): the device path's
time per member <= the host path's.

    python bench/gpu_batch_python.py [--model resnet50] [--batches 200]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import step_models  # noqa: E402


class HostTransport:
    """The shared-memory transport's surface, moving nothing."""
    rank, size, reads_parts, shared_memory = 0, 1, True, None

    def doing(self, what):
        pass

    def allreduce_parts(self, members, out, op, postscale, what):
        pass

    def allreduce(self, buf, op, postscale, what=""):
        pass


class DeviceTransport:
    """The NCCL transport's surface, enqueuing nothing."""
    rank, size, device_id = 0, 1, 0

    def __init__(self):
        self.stream = SimpleNamespace(ptr=0, wait_event=lambda e: None)

    @contextlib.contextmanager
    def activate(self):
        yield self.stream

    def enqueue_allreduce(self, src, dst, op, postscale):
        pass

    def finish(self):
        pass


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50", choices=["resnet50", "bert_base", "dense100"])
    p.add_argument("--batches", type=int, default=200)
    args = p.parse_args(argv)
    import cupy

    from horolite.coordination.tensor_queue import Entry, TensorQueue
    from horolite.core.handle import Handle
    from horolite.core.messages import Kind, Request, Response
    from horolite.execution.device_executor import DeviceExecutor
    from horolite.execution.executor import Executor

    shapes = getattr(step_models, args.model)()
    n = len(shapes)
    total = step_models.elements(shapes) * 4
    host_arrays = [np.ones(s, np.float32) for s in shapes]
    # Fake device memory: CuPy arrays at addresses nothing reads (no driver needed).
    fake = cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(1 << 40, 2 * total + (1 << 20), None, 0), 0)
    offsets = np.cumsum([0] + [-(-np.prod(s, dtype=np.int64) * 4 // 256) * 256 for s in shapes])
    dev_arrays = [cupy.ndarray(s, cupy.float32, fake + int(o)) for s, o in zip(shapes, offsets)]
    out = cupy.ndarray((total + n * 256,), cupy.uint8, fake + int(offsets[-1]))

    timeline = SimpleNamespace(enabled=False)
    executor = Executor(HostTransport(), TensorQueue(), 1 << 30, timeline)
    device = DeviceExecutor(DeviceTransport(), 1 << 30)
    pinned = np.empty(1 << 16, np.int64)
    calls = {"launch": 0, "alloc": 0}

    def launch(name, table, dst_ptr, total_bytes, unit, factor=None):
        pinned[:table.size] = table  # what _Tables.put does on the host before its one copy
        calls["launch"] += 1

    def alloc(nbytes):
        calls["alloc"] += 1
        return out[:nbytes]
    device._alloc, device._launch = alloc, launch
    executor.device = device

    def batch_of(arrays, dev):
        responses = [Response(kind=Kind.ALLREDUCE, name=f"g{i}", dtype="float32", shape=tuple(a.shape),
                              op=0, device=dev) for i, a in enumerate(arrays)]

        def entries():
            return [Entry(Request(r.name, Kind.ALLREDUCE, "float32", r.shape), a, Handle(r.name))
                    for r, a in zip(responses, arrays)]
        return responses, entries

    paths = {"host": batch_of(host_arrays, "cpu"), "device": batch_of(dev_arrays, "cuda")}
    times = {k: [] for k in paths}
    for b in range(args.batches + 5):
        for name, (responses, make) in paths.items():
            entries = make()
            t0 = time.perf_counter()
            executor.run(responses, entries)
            dt = time.perf_counter() - t0
            if b >= 5:
                times[name].append(dt)
            assert all(e.handle.done() for e in entries)
    per = {k: float(np.median(v)) / n * 1e6 for k, v in times.items()}
    batches = args.batches + 5
    print(f"{args.model}: {n} tensors, one fused allreduce batch, median of {args.batches}")
    print(f"  host path:   {per['host']:.2f} us per member ({per['host'] * n / 1e3:.3f} ms a batch)")
    print(f"  device path: {per['device']:.2f} us per member ({per['device'] * n / 1e3:.3f} ms a batch)"
          f"; {calls['launch'] / batches:.0f} launch and {calls['alloc'] / batches:.0f} allocation a batch")
    ratio = per["device"] / per["host"]
    print(f"  device / host: {ratio:.2f} (target <= 1.0: {'met' if ratio <= 1.0 else 'MISSED'})")


if __name__ == "__main__":
    main()
