"""Every NumPy dtype in both byte orders through every public collective.

What the runtime takes gives the NumPy reference's values (in native byte
order); what it cannot take is an InvalidCollectiveError at the call, naming
the tensor and the dtype, on the calling rank; never an exception in the
background thread. Afterwards a good collective still works.
"""
import numpy as np
import pytest

import horolite as hvd

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()

# The dtypes the runtime is expected to take: extend these lists when it takes more.
REDUCIBLE = ["uint8", "int8", "uint16", "int16", "int32", "int64", "float16", "bfloat16", "float32",
             "float64"]
MOVABLE = REDUCIBLE + ["bool"]


def all_dtypes():
    """Every dtype NumPy has (one per kind and size), in both byte orders where it has one."""
    seen = {}
    for t in set(np.sctypeDict.values()):
        d = np.dtype(t)
        if d.kind in "MmUSV":  # flexible or with units: give them a size/unit
            d = np.dtype({"M": "M8[s]", "m": "m8[s]", "U": "U3", "S": "S3", "V": "V4"}[d.kind])
        seen[d.str] = d
    seen["structured"] = np.dtype([("a", "<f4"), ("b", "<i4")])
    try:
        import ml_dtypes
        seen["bfloat16"] = np.dtype(ml_dtypes.bfloat16)
    except ImportError:
        pass
    out = []
    for d in seen.values():
        out.append(d)
        if d.byteorder not in "|" and d.fields is None:
            out.append(d.newbyteorder("<" if d.byteorder == ">" else ">"))
    return sorted(set(out), key=lambda d: d.str)


DTYPES = all_dtypes()


def sample(dtype, rows):
    """Small integer values every dtype can hold exactly, different on each rank."""
    values = (np.arange(rows * 2).reshape(rows, 2) + RANK) % 3
    if dtype.kind == "b":
        return (values > 0).astype(dtype)
    try:
        return values.astype(dtype)
    except (TypeError, ValueError):
        return np.zeros((rows, 2), dtype=dtype)


def check(got, want, dtype):
    assert got.dtype.isnative, got.dtype
    np.testing.assert_array_equal(np.asarray(got, dtype=np.float64), want)


CALLS = {
    "allreduce": (REDUCIBLE, lambda a, n: hvd.allreduce(a, op=hvd.Sum, name=n),
                  lambda parts: sum(parts)),
    "allreduce_async": (REDUCIBLE, lambda a, n: hvd.synchronize(hvd.allreduce_async(
        a, op=hvd.Max, name=n)), lambda parts: np.max(parts, axis=0)),
    "grouped_allreduce": (REDUCIBLE, lambda a, n: hvd.grouped_allreduce([a, a], op=hvd.Sum,
                                                                        name=n)[1],
                          lambda parts: sum(parts)),
    "reducescatter": (REDUCIBLE, lambda a, n: hvd.reducescatter(a, op=hvd.Sum, name=n),
                      lambda parts: np.array_split(sum(parts), SIZE)[RANK]),
    "grouped_reducescatter": (REDUCIBLE, lambda a, n: hvd.grouped_reducescatter(
        [a], op=hvd.Sum, name=n)[0], lambda parts: np.array_split(sum(parts), SIZE)[RANK]),
    "allgather": (MOVABLE, lambda a, n: hvd.allgather(a, name=n), np.concatenate),
    "grouped_allgather": (MOVABLE, lambda a, n: hvd.grouped_allgather([a], name=n)[0],
                          np.concatenate),
    "broadcast": (MOVABLE, lambda a, n: hvd.broadcast(a, root_rank=SIZE - 1, name=n),
                  lambda parts: parts[-1]),
    "alltoall": (MOVABLE, lambda a, n: hvd.alltoall(a, name=n),
                 lambda parts: np.concatenate([np.array_split(p, SIZE)[RANK] for p in parts])),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_every_dtype_and_byte_order(call):
    accepted, fn, reference = CALLS[call]
    rows = 2 * SIZE
    refused = []
    for i, dtype in enumerate(DTYPES):
        name = f"sweep.{call}.{i}"
        array = sample(dtype, rows)
        parts = [(np.arange(rows * 2).reshape(rows, 2) + r) % 3 for r in range(SIZE)]
        if dtype.kind == "b":
            parts = [(p > 0).astype(np.float64) for p in parts]
        if dtype.name in accepted and dtype.fields is None:
            got = fn(array, name)
            check(got, reference([p.astype(np.float64) for p in parts]), dtype)
        else:
            with pytest.raises(hvd.InvalidCollectiveError) as info:
                fn(array, name)
            msg = str(info.value)
            assert f"tensor '{name}" in msg and "is not supported by" in msg, msg
            refused.append(dtype.str)
    assert refused  # complex, strings, objects... exist in every NumPy
    got = hvd.allreduce(np.full(3, RANK, np.float64), op=hvd.Sum, name=f"sweep.{call}.after")
    np.testing.assert_array_equal(got, np.full(3, sum(range(SIZE))))


def test_other_inputs_the_runtime_cannot_take():
    bad = {"ragged": [[1, 2], [3]], "object": np.array([{}, 1], dtype=object),
           "string": "hello"}
    for label, value in bad.items():
        with pytest.raises(hvd.InvalidCollectiveError, match=f"tensor 'odd.{label}'"):
            hvd.allreduce(value, name=f"odd.{label}")
    # Unaligned and strided views are copied, not refused.
    raw = np.zeros(4 * 6 + 1, np.uint8)[1:].view(np.float32)
    raw[:] = RANK
    assert not raw.flags.aligned
    got = hvd.allreduce(raw, op=hvd.Sum, name="odd.unaligned")
    np.testing.assert_array_equal(got, np.full(6, sum(range(SIZE)), np.float32))
    got = hvd.allreduce(np.arange(12.0).reshape(3, 4)[:, ::2], op=hvd.Sum, name="odd.strided")
    np.testing.assert_array_equal(got, SIZE * np.arange(12.0).reshape(3, 4)[:, ::2])
