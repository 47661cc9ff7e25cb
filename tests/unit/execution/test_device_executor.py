"""The fused device path without a GPU: its tables, offsets, alignment, views and CUDA calls.

CuPy arrays here are views of aligned host memory (CuPy makes arrays over any address
without a driver), the gather launch is carried out on that memory with memmove from
the very table the kernel would read, and the fake NCCL combines identical inputs of
`size` ranks. Results are compared with NumPy. What this cannot show is the kernel
running on a GPU: that is tools/gpu_checks.sh's.
"""
import contextlib
import ctypes
from types import SimpleNamespace

import numpy as np
import pytest

cupy = pytest.importorskip("cupy", reason="cupy not installed: the device path's views are CuPy arrays")

from horolite.coordination.tensor_queue import Entry, TensorQueue  # noqa: E402
from horolite.core.device import Ready, last_ready  # noqa: E402
from horolite.core.handle import Handle  # noqa: E402
from horolite.core.messages import Kind, Request, Response  # noqa: E402
from horolite.execution.device_executor import DeviceExecutor  # noqa: E402
from horolite.execution.device_layout import ALIGN  # noqa: E402

sys_path_bench = __import__("os").path.join(__import__("os").path.dirname(__file__), "..", "..", "..", "bench")
__import__("sys").path.insert(0, sys_path_bench)
import step_models  # noqa: E402


class HostMemory:
    """Aligned host buffers posing as device memory."""

    def __init__(self):
        self.keep, self.allocs = [], 0

    def alloc(self, nbytes):
        self.allocs += 1
        raw = np.zeros(nbytes + 2 * ALIGN, np.uint8)
        off = (-raw.ctypes.data) % ALIGN
        mem = cupy.cuda.UnownedMemory(raw.ctypes.data + off, max(nbytes, 1), raw, 0)
        self.keep.append(raw)
        return cupy.ndarray((nbytes,), cupy.uint8, cupy.cuda.MemoryPointer(mem, 0))

    def device(self, host):
        host = np.array(host, order="C")  # (ascontiguousarray makes a 0-d array 1-d)
        buf = self.alloc(host.nbytes)
        write(buf.data.ptr, host)
        return cupy.ndarray(host.shape, host.dtype, buf.data)


def write(ptr, host):
    host = np.array(host, order="C")
    ctypes.memmove(ptr, host.ctypes.data, host.nbytes)


def read(array):
    raw = ctypes.string_at(array.data.ptr, array.nbytes) if array.nbytes else b""
    return np.frombuffer(raw, dtype=array.dtype).reshape(array.shape).copy()


class FakeNCCL:
    """`size` ranks with identical inputs: a sum is size times this rank's."""

    def __init__(self, size=1, rank=0, fill=None):
        self.size, self.rank, self.device_id = size, rank, 0
        self.stream = SimpleNamespace(ptr=7, waits=[], wait_event=lambda e: self.stream.waits.append(e))
        self.calls, self.fill = [], fill

    @contextlib.contextmanager
    def activate(self):
        yield self.stream

    def enqueue_allreduce(self, src, dst, op, postscale):
        self.calls.append(("allreduce", src.data.ptr, dst.data.ptr, dst.size))
        write(dst.data.ptr, (read(src) * self.size * postscale).astype(dst.dtype))

    def enqueue_broadcast(self, buf, root):
        self.calls.append(("broadcast", buf.data.ptr, buf.nbytes, root))

    def enqueue_allgather(self, buf, segment):
        self.calls.append(("allgather", buf.data.ptr, segment))
        self.fill(buf, segment)

    def enqueue_reducescatter(self, send, recv, op, postscale):
        self.calls.append(("reducescatter", send.data.ptr, recv.data.ptr, recv.size))
        mine = read(send)[self.rank * recv.size:(self.rank + 1) * recv.size]
        write(recv.data.ptr, (mine * self.size * postscale).astype(recv.dtype))

    def finish(self):
        self.calls.append(("finish",))


class FakeHost:
    def __init__(self):
        self.queue, self.timeline = TensorQueue(), SimpleNamespace(enabled=False)

    def _queue_spans(self, batch, entries):
        return 0.0

    def _span(self, *args):
        pass

    def complete(self, resp, entry, value=None, error=None):
        if entry is not None:
            entry.handle._set_result(value)


def executor(size=1, rank=0, fill=None):
    mem, nccl = HostMemory(), FakeNCCL(size, rank, fill)
    ex = DeviceExecutor(nccl, 64 << 20)
    launches = []

    def launch(name, table, dst_ptr, total_bytes, unit, factor=None):
        launches.append((name, table.copy(), dst_ptr, total_bytes, unit, factor))
        n = len(table) // 3
        for src, start, count in zip(table[:n].view(np.uint64), table[n:2 * n], table[2 * n:]):
            if name.startswith("hl_copy") and count:
                if src:
                    ctypes.memmove(dst_ptr + int(start) * unit, int(src), int(count) * unit)
                else:
                    ctypes.memset(dst_ptr + int(start) * unit, 0, int(count) * unit)
    ex._alloc, ex._launch = mem.alloc, launch
    return ex, mem, nccl, launches


def run(ex, kind, arrays, names=None, **fields):
    host = FakeHost()
    names = names or [f"t{i}" for i in range(len(arrays))]
    batch, entries = [], []
    joined_shape = fields.pop("joined_shape", None)
    for name, a in zip(names, arrays):
        shape = tuple(a.shape) if a is not None else joined_shape
        dtype = str(a.dtype) if a is not None else "float32"
        batch.append(Response(kind=kind, name=name, dtype=dtype, shape=shape, device="cuda", **fields))
        entries.append(None if a is None else
                       Entry(Request(name, kind, dtype, shape), a, Handle(name)))
    ex.run(host, batch, entries)
    return [e.handle.result(timeout=0) for e in entries if e is not None]


def test_a_resnet50_step_is_one_launch_one_buffer_one_nccl_call():
    ex, mem, nccl, launches = executor(size=2)
    shapes = step_models.resnet50()
    rng = np.random.default_rng(5)
    host = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    inputs = [mem.device(h) for h in host]
    before = mem.allocs
    got = run(ex, Kind.ALLREDUCE, inputs, op=0)  # Average over 2 identical ranks
    assert mem.allocs - before == 1, "one result buffer for the batch, not one per member"
    assert len(launches) == 1 and launches[0][0] == "hl_copy_16"
    assert [c[0] for c in nccl.calls] == ["allreduce", "finish"]
    _, buf_ptr, dst_ptr, _ = nccl.calls[0]
    assert buf_ptr == dst_ptr == launches[0][2]  # in place, in the buffer packed
    for g, h, shape in zip(got, host, shapes):
        assert isinstance(g, cupy.ndarray) and g.shape == shape and g.dtype == np.float32
        assert (g.data.ptr - buf_ptr) % ALIGN == 0
        np.testing.assert_array_equal(read(g), h)  # average of two identical ranks
    starts = [g.data.ptr - buf_ptr for g in got]
    assert starts == sorted(starts) and starts[0] == 0
    ends = [s + h.nbytes for s, h in zip(starts, host)]
    assert all(e <= s < e + ALIGN for e, s in zip(ends, starts[1:]))  # packed, only aligned


def test_prescale_is_fused_into_the_pack():
    ex, mem, nccl, launches = executor()
    inputs = [mem.device(np.arange(n, dtype=np.float16)) for n in (3, 5)]
    run(ex, Kind.ALLREDUCE, inputs, op=1, prescale=0.5)  # Sum
    (name, table, _, total, unit, factor), = launches
    assert (name, unit, factor) == ("hl_scale_float16", 2, 0.5)
    assert table[:2].view(np.uint64).tolist() == [a.data.ptr for a in inputs]
    assert table[2:4].tolist() == [0, ALIGN // 2] and table[4:].tolist() == [3, 5]


def test_a_single_tensor_goes_from_its_input_straight_into_its_result():
    ex, mem, nccl, launches = executor(size=3)
    x = np.arange(12, dtype=np.int32).reshape(3, 4)
    a = mem.device(x)
    (got,) = run(ex, Kind.ALLREDUCE, [a], op=1)
    assert launches == [] and nccl.calls[0][1] == a.data.ptr != nccl.calls[0][2] == got.data.ptr
    np.testing.assert_array_equal(read(got), x * 3)
    np.testing.assert_array_equal(read(a), x)  # the input is left alone


def test_a_joined_rank_contributes_zeros_from_a_null_pointer():
    ex, mem, nccl, launches = executor(size=2)
    a = mem.device(np.ones(6, np.float32))
    got = run(ex, Kind.ALLREDUCE, [a, None], op=1, joined=(0,), joined_shape=(4,))
    table = launches[0][1]
    assert table[:2].view(np.uint64).tolist() == [a.data.ptr, 0]
    np.testing.assert_array_equal(read(got[0]), np.full(6, 2.0))


def test_grouped_broadcast_packs_on_the_root_only():
    weights = [np.full(s, i, np.float32) for i, s in enumerate([(3, 3), (7,), (), (2, 5)])]
    for rank, root in ((0, 0), (1, 0)):
        ex, mem, nccl, launches = executor(size=2, rank=rank)
        got = run(ex, Kind.BROADCAST, [mem.device(w) for w in weights], root=root)
        assert len(launches) == (1 if rank == root else 0)
        assert [c[0] for c in nccl.calls] == ["broadcast", "finish"] and nccl.calls[0][3] == root
        assert [g.shape for g in got] == [w.shape for w in weights]
        if rank == root:
            for g, w in zip(got, weights):
                np.testing.assert_array_equal(read(g), w)


def test_grouped_allgather_uneven_rows_one_pack_one_unpack():
    size, rank = 3, 1
    rows = {0: [2, 0, 3], 1: [1, 4, 2]}  # member -> first dim on each rank
    tails = {0: (3,), 1: (2, 2)}
    dtypes = {0: np.float64, 1: np.uint8}

    def part(m, r):
        return (np.arange(rows[m][r] * int(np.prod(tails[m]))) + 100 * r + 10 * m).astype(
            dtypes[m]).reshape((rows[m][r],) + tails[m])

    def fill(buf, segment):  # the other ranks' segments, laid out independently here
        for r in range(size):
            if r == rank:
                continue
            offset = 0
            for m in (0, 1):
                p = part(m, r)
                write(buf.data.ptr + r * segment + offset, p)
                offset += -(-p.nbytes // ALIGN) * ALIGN

    ex, mem, nccl, launches = executor(size, rank, fill)
    host = FakeHost()
    batch, entries = [], []
    for m in (0, 1):
        a = mem.device(part(m, rank))
        name = f"ag{m}"
        batch.append(Response(kind=Kind.ALLGATHER, name=name, dtype=np.dtype(dtypes[m]).name,
                              shape=a.shape, device="cuda", first_dims=tuple(rows[m])))
        entries.append(Entry(Request(name, Kind.ALLGATHER, batch[-1].dtype, a.shape), a, Handle(name)))
    ex.run(host, batch, entries)
    assert len(launches) == 2 and [c[0] for c in nccl.calls] == ["allgather", "finish"]
    for m, e in zip((0, 1), entries):
        want = np.concatenate([part(m, r) for r in range(size)])
        got = e.handle.result(timeout=0)
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_array_equal(read(got), want)


@pytest.mark.parametrize("size,rank", [(1, 0), (3, 0), (3, 2)])
def test_grouped_reducescatter_one_pack_one_call(size, rank):
    shapes = [(7, 2), (1,), (8, 3)]
    inputs = [np.arange(np.prod(s), dtype=np.float32).reshape(s) + i for i, s in enumerate(shapes)]
    ex, mem, nccl, launches = executor(size, rank)
    got = run(ex, Kind.REDUCESCATTER, [mem.device(x) for x in inputs], op=1)
    assert len(launches) == 1 and [c[0] for c in nccl.calls] == ["reducescatter", "finish"]
    for g, x in zip(got, inputs):
        base, extra = divmod(x.shape[0], size)
        lo = rank * base + min(rank, extra)
        np.testing.assert_array_equal(read(g), x[lo:lo + base + (rank < extra)] * size)


def test_a_batch_waits_once_per_caller_stream():
    ev = [f"e{i}" for i in range(5)]
    readies = [Ready(ev[0], (0, 0, 1), 3), Ready(ev[1], (0, 0, 1), 9), None,
               Ready(ev[2], (0, 5, 1), 4), Ready(ev[3], (0, 0, 1), 6), Ready(ev[4], (0, 0, 2), 1)]
    assert sorted(last_ready(readies)) == ["e1", "e2", "e4"]
    ex, mem, nccl, _ = executor()
    host = FakeHost()
    arrays = [mem.device(np.ones(4, np.float32)) for _ in readies]
    batch = [Response(kind=Kind.ALLREDUCE, name=f"w{i}", dtype="float32", shape=(4,), device="cuda")
             for i in range(len(arrays))]
    entries = [Entry(Request(r.name, Kind.ALLREDUCE, "float32", (4,)), a, Handle(r.name), ready=rd)
               for r, a, rd in zip(batch, arrays, readies)]
    ex.run(host, batch, entries)
    assert sorted(nccl.stream.waits) == ["e1", "e2", "e4"]


def test_a_fused_result_buffer_is_reused_only_once_nothing_refers_to_it():
    ex, mem, nccl, launches = executor()
    inputs = [mem.device(np.full(5, i, np.float32)) for i in range(3)]
    # cached responses come back as the same objects every step
    batch = [Response(kind=Kind.ALLREDUCE, name=n, dtype="float32", shape=(5,), op=1, device="cuda")
             for n in "abc"]

    def step():
        entries = [Entry(Request(r.name, Kind.ALLREDUCE, "float32", (5,)), a, Handle(r.name))
                   for r, a in zip(batch, inputs)]
        ex.run(FakeHost(), batch, entries)
        return [e.handle.result(timeout=0) for e in entries]
    first = step()
    allocs = mem.allocs
    held = first[1].reshape(5, 1)  # a view of a result keeps the buffer
    del first
    second = step()
    assert second[1].data.ptr != held.data.ptr and mem.allocs == allocs + 1
    np.testing.assert_array_equal(read(held), np.full((5, 1), 1.0))
    ptrs = [g.data.ptr for g in second]
    del held, second
    third = step()
    assert mem.allocs == allocs + 1 and [g.data.ptr for g in third] == ptrs  # no allocation
    np.testing.assert_array_equal(read(third[2]), np.full(5, 2.0))
