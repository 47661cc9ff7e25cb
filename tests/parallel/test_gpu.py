"""The GPU path under mpirun (tests/test_matrix_gpu.py runs this on 1-4 ranks).

Two kinds of tests:

* What needs no GPU runs here for real: the exchange of a 128-byte NCCL id
  over MPI, device selection from the local rank, and the host path with CuPy
  installed but no driver.
* The collective checks of test_collectives.py, parametrised over the device:
  "cpu" runs everywhere, "cuda" runs on CuPy arrays where this rank has a GPU
  and is skipped, with the reason, where not. Each "cuda" case asserts the
  route its arrays took: NCCL when the job has it (every rank its own GPU, or
  the test switch HOROLITE_TEST_NCCL_SHARED_GPU=1 on one GPU), else staged
  through host memory (ranks sharing a GPU as users run them). No fake NCCL.
"""
import os

import numpy as np
import pytest
from horolite.core.mpi_library import MPI  # the job world's: mpi4py's under mpirun

import horolite as hvd
from horolite.core import device, staging
from horolite.transport.nccl import NCCL_UNIQUE_ID_BYTES, exchange_unique_id
from test_collectives import assert_close, make, np_dtype, reference

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
RT = hvd.api.basics.runtime()
NCCL_UP = RT.nccl is not None
GPU_HERE = device.cuda_device_count() > 0
multi = pytest.mark.skipif(SIZE == 1, reason="needs at least two ranks")
needs_gpu = pytest.mark.skipif(not GPU_HERE, reason=device.nccl_status()[1])
needs_nccl = pytest.mark.skipif(not NCCL_UP, reason=RT.nccl_reason)
DEVICES = ["cpu", pytest.param("cuda", marks=needs_gpu)]


@pytest.fixture(autouse=True)
def route_taken(request, monkeypatch):
    """A "cuda" case's arrays went over NCCL when the job has it, else through host memory."""
    params = getattr(request.node, "callspec", None)
    if params is None or params.params.get("dev") != "cuda":
        yield
        return
    staged = []
    real = staging.to_pinned_host
    monkeypatch.setattr(staging, "to_pinned_host", lambda a: staged.append(a.shape) or real(a))
    yield
    if NCCL_UP:
        assert not staged, f"NCCL is up but {len(staged)} device arrays went through the host"
    else:
        assert staged, "NCCL is off but no device array was staged through host memory"


def home_device():
    """Where results come back: the NCCL device, or the caller's current device when staged."""
    if NCCL_UP:
        return RT.nccl.device_id
    import cupy
    return cupy.cuda.Device().id


def to_device(x, dev):
    if dev == "cpu":
        return x
    import cupy
    return cupy.asarray(x)


def to_host(y, dev):
    if dev == "cpu":
        assert isinstance(y, np.ndarray), type(y)
        return y
    import cupy
    assert isinstance(y, cupy.ndarray), f"a device collective returned {type(y).__name__}"
    assert y.device.id == home_device()
    return cupy.asnumpy(y)


# ---- no GPU needed: the NCCL id over real MPI ----
@pytest.mark.parametrize("root", sorted({0, SIZE - 1}))
def test_unique_id_reaches_every_rank(root):
    comm = MPI.COMM_WORLD
    mine = os.urandom(NCCL_UNIQUE_ID_BYTES) if comm.Get_rank() == root else None
    got = exchange_unique_id(mine, comm, root=root)
    assert isinstance(got, bytes) and len(got) == NCCL_UNIQUE_ID_BYTES
    everyone = comm.allgather(got)
    roots = comm.bcast(mine, root=root)  # what root actually generated, compared independently
    assert everyone == [roots] * SIZE


def test_unique_id_in_the_form_older_cupy_returns():
    comm = MPI.COMM_WORLD
    raw = bytes((i * 37 + 11) % 256 for i in range(NCCL_UNIQUE_ID_BYTES))
    signed = tuple(b - 256 if b > 127 else b for b in raw)
    got = exchange_unique_id(signed if RANK == 0 else None, comm)
    assert got == raw


def test_unique_id_on_a_sub_communicator():
    """One id per process set: two halves exchange different ids at once."""
    world = MPI.COMM_WORLD
    half = world.Split(color=RANK % 2, key=RANK)
    try:
        mine = bytes([RANK % 2 + 1]) * NCCL_UNIQUE_ID_BYTES if half.Get_rank() == 0 else None
        assert exchange_unique_id(mine, half) == bytes([RANK % 2 + 1]) * NCCL_UNIQUE_ID_BYTES
    finally:
        half.Free()


def test_bad_unique_id_fails_on_every_rank_without_hanging():
    # Every rank raises; root's message also says what was wrong with its id.
    detail = "128 bytes, got 5" if RANK == 0 else "to share$"
    with pytest.raises(RuntimeError, match=f"^rank 0 had no valid NCCL unique id.*{detail}"):
        exchange_unique_id(b"short" if RANK == 0 else None, MPI.COMM_WORLD)
    detail = "ncclGetUniqueId gave no id" if RANK == 0 else "to share$"
    with pytest.raises(RuntimeError, match=f"^rank 0 had no valid NCCL unique id.*{detail}"):
        exchange_unique_id(None, MPI.COMM_WORLD)
    # The communicator is still in step afterwards.
    assert MPI.COMM_WORLD.allreduce(1) == SIZE


# ---- no GPU needed: device selection from the local rank ----
def test_device_selection_from_local_rank_under_mpirun(monkeypatch):
    monkeypatch.delenv("HOROLITE_GPU_DEVICE", raising=False)
    monkeypatch.delenv("HOROVOD_GPU_DEVICE", raising=False)
    local = hvd.local_rank()
    for count in (1, 2, 3, 4, 8):
        assert device.device_for_rank(local, count) == local % count
    # With a GPU per local rank, ranks on one host pick distinct devices.
    picks = MPI.COMM_WORLD.allgather((MPI.Get_processor_name(),
                                      device.device_for_rank(local, hvd.local_size())))
    for host in {h for h, _ in picks}:
        on_host = [d for h, d in picks if h == host]
        assert sorted(on_host) == list(range(len(on_host)))
    monkeypatch.setenv("HOROLITE_GPU_DEVICE", "1,0")
    assert device.device_for_rank(local, 2) == [1, 0][local % 2]


def test_runtime_device_matches_selection():
    if not NCCL_UP:
        assert RT.nccl_reason
        assert RT.executor.device is None
        pytest.skip(f"no NCCL transport here: {RT.nccl_reason}")
    assert RT.nccl.device_id == device.device_for_rank(hvd.local_rank(), device.cuda_device_count())


# ---- no GPU needed: the host path with CuPy installed but no driver ----
def test_host_path_with_cupy_imported():
    try:
        import cupy  # noqa: F401  (a CuPy that may find no driver)
    except Exception as exc:
        pytest.skip(f"cupy not importable here: {exc}")
    x = np.full(5, RANK + 1.0, dtype=np.float32)
    got = hvd.allreduce(x, op=hvd.Sum, name="gpu.hostpath")
    np.testing.assert_allclose(got, np.full(5, SIZE * (SIZE + 1) / 2))
    assert isinstance(got, np.ndarray)
    if not NCCL_UP:
        ok, reason = device.nccl_status()
        if ok:  # this rank could use NCCL: the job decided against it (decide_nccl)
            assert "would share one GPU" in RT.nccl_reason or "not every rank" in RT.nccl_reason
        else:
            assert RT.nccl_reason == reason or "not every rank" in RT.nccl_reason


# ---- the collective matrix, parametrised over the device ----
DTYPES = ["uint8", "int8", "int32", "int64", "float16", "float32", "float64"]
OPS = [hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product]
SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 0, 3), (1031,)]


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
def test_allreduce(dev, dtype, op):
    handles, refs = [], []
    for i, shape in enumerate(SHAPES):
        key = ("gpu", dtype, int(op), i)
        high = 3 if op == hvd.Product else 5
        x = to_device(make(RANK, shape, dtype, key, high=high), dev)
        before = to_host(x.copy(), dev)
        handles.append((hvd.allreduce_async(x, op=op, name=f"{dev}.ar.{dtype}.{op.name}.{i}"), x, before))
        refs.append(reference(op, [make(r, shape, dtype, key, high=high) for r in range(SIZE)], dtype))
    for (h, x, before), want in zip(handles, refs):
        got = to_host(hvd.synchronize(h), dev)
        assert got.dtype == np_dtype(dtype)
        assert_close(got, want, dtype)
        assert np.array_equal(to_host(x, dev), before), "input was modified"


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "int32", "float16"])
@pytest.mark.parametrize("elements", [70001, 3 << 20], ids=["mid", "rs_ag"])
def test_allreduce_large_and_scaled(dev, dtype, elements):
    # 3 * 2**20 elements divide by 1-4 ranks and exceed RS_AG_MIN_BYTES: the
    # reduceScatter -> scale -> allGather path on the device.
    key = ("gpu.big", dtype, elements)
    x = to_device(make(RANK, (elements,), dtype, key), dev)
    got = to_host(hvd.allreduce(x, op=hvd.Average, name=f"{dev}.big.{dtype}.{elements}",
                                prescale_factor=0.5, postscale_factor=3.0), dev)
    inputs = [make(r, (elements,), dtype, key).astype(np.float64) for r in range(SIZE)]
    if np_dtype(dtype).kind in "iu":
        want = np.trunc(np.sum([np.trunc(a * 0.5) for a in inputs], axis=0) * 3.0 / SIZE)
    else:
        want = np.sum([a * 0.5 for a in inputs], axis=0) * 3.0 / SIZE
    assert_close(got, want, dtype)


@pytest.mark.parametrize("dev", DEVICES)
def test_grouped_allreduce_fuses(dev):
    shapes = [(3,), (4, 2), ()] + [(64,)] * 20
    arrays = [to_device(make(RANK, s, "float32", ("gg", i)), dev) for i, s in enumerate(shapes)]
    got = hvd.grouped_allreduce(arrays, op=hvd.Sum, name=f"{dev}.group")
    for i, (g, s) in enumerate(zip(got, shapes)):
        assert_close(to_host(g, dev), reference(hvd.Sum, [make(r, s, "float32", ("gg", i))
                                                          for r in range(SIZE)], "float32"), "float32")


@pytest.mark.parametrize("dev", DEVICES)
def test_grouped_allgather_broadcast_reducescatter_fuse(dev):
    """Many tensors at once (on the GPU: one pack launch and one NCCL call per batch)."""
    def shape(i, r):  # member i's shape on rank r: first dims differ between ranks
        return [(r % 3 + 1, 3), (0, 2), (5,), (2 + r, 2, 2)][i]

    parts = [make(RANK, shape(i, RANK), "float32", ("gga", i)) for i in range(4)]
    got = hvd.grouped_allgather([to_device(p, dev) for p in parts], name=f"{dev}.gag")
    for i, g in enumerate(got):
        want = np.concatenate([make(r, shape(i, r), "float32", ("gga", i)) for r in range(SIZE)])
        np.testing.assert_array_equal(to_host(g, dev), want)
    weights = [make(RANK, s, "int64", ("gbw", i)) for i, s in enumerate([(4, 3), (), (7,)])]
    handles = [hvd.broadcast_async(to_device(w, dev), 0, name=f"{dev}.gbw.{i}")
               for i, w in enumerate(weights)]
    for i, (h, w) in enumerate(zip(handles, weights)):
        np.testing.assert_array_equal(to_host(hvd.synchronize(h), dev),
                                      make(0, w.shape, "int64", ("gbw", i)))
    full = [(7, 2), (1,), (SIZE * 2, 3)]
    xs = [make(RANK, s, "float32", ("grs", i)) for i, s in enumerate(full)]
    got = hvd.grouped_reducescatter([to_device(x, dev) for x in xs], op=hvd.Sum, name=f"{dev}.grs",
                                    prescale_factor=0.5)
    for i, (g, s) in enumerate(zip(got, full)):
        total = reference(hvd.Sum, [make(r, s, "float32", ("grs", i)) * np.float32(0.5)
                                    for r in range(SIZE)], "float32")
        base, extra = divmod(s[0], SIZE)
        start = RANK * base + min(RANK, extra)
        assert_close(to_host(g, dev), total[start:start + base + (1 if RANK < extra else 0)], "float32")


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES + ["bool"])
def test_allgather_uneven_first_dim(dev, dtype):
    def part(r):
        rows = (r * 2 + 1) % 4
        if dtype == "bool":
            return (np.arange(rows * 3).reshape(rows, 3) + r) % 2 == 0
        return make(r, (rows, 3), dtype, ("gag", dtype))

    got = to_host(hvd.allgather(to_device(part(RANK), dev), name=f"{dev}.ag.{dtype}"), dev)
    want = np.concatenate([part(r) for r in range(SIZE)])
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.array_equal(got.astype(np.float64), want.astype(np.float64))


@pytest.mark.parametrize("dev", DEVICES)
def test_allgather_even_and_zero_rows(dev):
    even = to_host(hvd.allgather(to_device(np.full((2, 2), RANK, np.int32), dev),
                                 name=f"{dev}.ag.even"), dev)
    assert np.array_equal(even, np.repeat(np.arange(SIZE, dtype=np.int32), 2)[:, None] * np.ones(2))
    got = to_host(hvd.allgather(to_device(np.full((RANK % 2, 2), RANK, np.int32), dev),
                                name=f"{dev}.ag.zero"), dev)
    assert np.array_equal(got, np.concatenate([np.full((r % 2, 2), r, np.int32) for r in range(SIZE)]))


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype", ["uint8", "int64", "float16", "float32", "bool"])
def test_broadcast_every_root(dev, dtype):
    for root in range(SIZE):
        x = make(RANK, (4, 3), dtype, ("gbc", dtype)) if dtype != "bool" else np.full(5, RANK == root)
        got = to_host(hvd.broadcast(to_device(x, dev), root_rank=root, name=f"{dev}.bc.{dtype}.{root}"), dev)
        want = make(root, (4, 3), dtype, ("gbc", dtype)) if dtype != "bool" else np.full(5, True)
        assert np.array_equal(got.astype(np.float64), want.astype(np.float64))


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype", ["uint8", "int64", "float16", "float32", "bool"])
def test_alltoall_with_splits(dev, dtype):
    def splits_of(r):
        return np.array([(r + d) % 3 for d in range(SIZE)])

    def rows_for(r, d):
        block = np.full(((r + d) % 3, 2), r * 10 + d, dtype=np.float64)
        return (block % 2 == 0) if dtype == "bool" else block.astype(np_dtype(dtype))

    send = np.concatenate([rows_for(RANK, d) for d in range(SIZE)])
    out, recv_splits = hvd.alltoall(to_device(send, dev), splits=splits_of(RANK), name=f"{dev}.a2a.{dtype}")
    want = np.concatenate([rows_for(s, RANK) for s in range(SIZE)])
    assert np.array_equal(np.asarray(recv_splits), [splits_of(s)[RANK] for s in range(SIZE)])
    assert np.array_equal(to_host(out, dev).astype(np.float64), want.astype(np.float64))


@pytest.mark.parametrize("dev", DEVICES)
def test_alltoall_even_default(dev):
    send = np.arange(SIZE * 2, dtype=np.int32) + 100 * RANK
    out = to_host(hvd.alltoall(to_device(send, dev), name=f"{dev}.a2a.even"), dev)
    want = np.concatenate([np.arange(RANK * 2, RANK * 2 + 2, dtype=np.int32) + 100 * s
                           for s in range(SIZE)])
    assert np.array_equal(out, want)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average, hvd.Max])
@pytest.mark.parametrize("rows", [1, 7, 8])
def test_reducescatter(dev, dtype, op, rows):
    key = ("grs", dtype, int(op), rows)
    x = to_device(make(RANK, (rows, 3), dtype, key), dev)
    got = to_host(hvd.reducescatter(x, op=op, name=f"{dev}.rs.{dtype}.{op.name}.{rows}"), dev)
    full = reference(op, [make(r, (rows, 3), dtype, key) for r in range(SIZE)], dtype)
    base, extra = divmod(rows, SIZE)
    start = RANK * base + min(RANK, extra)
    assert_close(got, full[start:start + base + (1 if RANK < extra else 0)], dtype)


@pytest.mark.parametrize("dev", DEVICES)
def test_join_contributes_zeros_on_the_device(dev):
    hvd.barrier()
    for step in range(RANK):
        got = to_host(hvd.allreduce(to_device(np.ones(4, np.float32), dev), op=hvd.Sum,
                                    name=f"{dev}.join.step{step}"), dev)
        np.testing.assert_allclose(got, np.full(4, len([r for r in range(SIZE) if r > step])))
    hvd.join()
    got = hvd.allreduce(to_device(np.ones(2), dev), op=hvd.Sum, name=f"{dev}.after.join")
    np.testing.assert_allclose(to_host(got, dev), np.full(2, SIZE))


# ---- GPU only: errors ----
@needs_nccl
@multi
def test_host_and_device_under_one_name_is_a_mismatch():
    x = to_device(np.ones(3, np.float32), "cuda" if RANK else "cpu")
    with pytest.raises(hvd.TensorMismatchError) as info:
        hvd.allreduce(x, name="gpu.mixed")
    others = "rank 1" if SIZE == 2 else "ranks " + ", ".join(str(r) for r in range(1, SIZE))
    assert str(info.value) == f"tensor 'gpu.mixed': mismatched device: rank 0 had cpu, {others} had cuda"
    # The runtime carries on, on both paths.
    np.testing.assert_allclose(to_host(hvd.allreduce(to_device(np.ones(2), "cuda"), op=hvd.Sum,
                                                     name="gpu.after.mixed"), "cuda"), np.full(2, SIZE))


@needs_nccl
def test_array_on_another_gpu_is_refused():
    import cupy
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two visible GPUs")
    other = (RT.nccl.device_id + 1) % cupy.cuda.runtime.getDeviceCount()
    with cupy.cuda.Device(other):
        x = cupy.ones(3)
    with pytest.raises(hvd.InvalidCollectiveError, match=f"is on cuda:{other} but this rank's NCCL"):
        hvd.allreduce(x, name="gpu.wrongdevice")


@needs_gpu
def test_user_stream_work_is_waited_for():
    """Input written on a user stream just before submit is what gets reduced (ready events)."""
    import cupy
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        x = cupy.zeros(1 << 20, dtype=cupy.float32)
        x += RANK + 1  # still queued on `stream` when allreduce is called
        got = hvd.allreduce(x, op=hvd.Sum, name="gpu.userstream")
    assert float(got[0]) == float(got[-1]) == SIZE * (SIZE + 1) / 2


def tensorflow_with_a_gpu():
    """TensorFlow, where it is installed and sees a GPU; else skip saying what is not covered."""
    tf = pytest.importorskip(
        "tensorflow", reason="TensorFlow is not installed here (a GPU build needs CUDA 12 "
        "libraries): the route after its DLPack handoff is the CuPy path tested above")
    if not tf.config.list_physical_devices("GPU"):
        pytest.skip("TensorFlow sees no GPU (a CPU build?): its GPU route is not covered here")
    return tf


@needs_nccl
def test_tensorflow_gpu_tensor_round_trip():
    tf = tensorflow_with_a_gpu()
    with tf.device(f"/GPU:{RT.nccl.device_id}"):
        t = tf.fill([4], float(RANK + 1))
    out = device.cupy_to_tf(hvd.allreduce(device.tf_to_cupy(t), op=hvd.Sum, name="gpu.tf"))
    np.testing.assert_allclose(out.numpy(), np.full(4, SIZE * (SIZE + 1) / 2))
    # An eager GPU tensor passed as it is: DLPack, without TensorFlow's (refused) stream handshake.
    direct = hvd.allreduce(t, op=hvd.Sum, name="gpu.tf.direct")
    np.testing.assert_allclose(to_host(direct, "cuda"), np.full(4, SIZE * (SIZE + 1) / 2))


@needs_nccl
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_tensorflow_adapter_keeps_gpu_tensors_on_the_gpu(mode, monkeypatch):
    tf = tensorflow_with_a_gpu()
    import cupy
    import horolite.tensorflow as hvd_tf
    from horolite.tensorflow import bridge
    # The route, not only where the result lives (TensorFlow copies a py_function's
    # outputs to the op's device whatever route the tensor took).
    handed = []
    real = bridge._to_runtime
    monkeypatch.setattr(bridge, "_to_runtime", lambda t: handed.append(real(t)) or handed[-1])
    with tf.device(f"/GPU:{RT.nccl.device_id}"):
        x = tf.fill([5], float(RANK + 1))

        def reduce(t):
            return hvd_tf.allreduce(t, op=hvd.Sum, name=f"gpu.adapter.{mode}")
        out = reduce(x) if mode == "eager" else tf.function(reduce)(x)
    assert "GPU" in out.device
    np.testing.assert_allclose(out.numpy(), np.full(5, SIZE * (SIZE + 1) / 2))
    assert handed and all(isinstance(a, cupy.ndarray) for a in handed), \
        f"the tensor reached the runtime as {[type(a).__name__ for a in handed]}, not over NCCL"
