"""GPU allreduce: horolite on CuPy arrays against a device copy, or against the host path.

Which comparison runs depends on what the job has (horolite decides at init):

* NCCL up (every rank its own GPU; run it at np 1): for float32 buffers of
  4 KiB to 256 MiB, horolite.allreduce of a CuPy array (the full public path:
  queue, negotiation, fusion buffer, NCCL, result) against one device-to-device
  copy of the same bytes. Targets: from 64 MiB up, the copy's time / horolite's
  time >= 0.9; horolite's own time per call (its time minus the copy's, at
  4 KiB) <= 50 us.
* NCCL off with a GPU here (np 2 on one GPU: the ranks share it): the staged
  path (device -> pinned host -> host allreduce -> device) against the host
  path on a NumPy array plus a device-to-host and a host-to-device copy of the
  same bytes, timed separately and added. Target: from 4 MiB up, staged <= 1.1x
  host + copies.

Without a GPU it prints why it skipped and exits 0 (it writes no results).

    horolite-run -np 1 python bench/gpu_allreduce.py    # NCCL vs a device copy
    horolite-run -np 2 python bench/gpu_allreduce.py    # one GPU: staged vs host + copies
"""
from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI

import common
from common import Target, human_bytes, median_time

DEFAULT_SIZES = [4 << 10 << (2 * k) for k in range(9)]  # 4 KiB, ..., 256 MiB
TINY_SIZES = [4 << 10, 1 << 20]
MiB = 1 << 20


def skip_reason():
    """Why this machine cannot run the benchmark, or None (no CuPy import without a GPU)."""
    from horolite.core.device import cuda_device_count, nccl_status
    if cuda_device_count() == 0:
        return nccl_status()[1]
    return None


def device_copy_fn(cupy, src, dst):
    def run():
        cupy.cuda.runtime.memcpy(dst.data.ptr, src.data.ptr, src.nbytes,
                                 cupy.cuda.runtime.memcpyDeviceToDevice)
        cupy.cuda.Device().synchronize()
    return run


def nccl_rows(hvd, cupy, comm, sizes, iters):
    rows = []
    for s in sizes:
        x = cupy.full(s // 4, 1.0, dtype=cupy.float32)
        y = cupy.empty_like(x)
        name = f"gpu.bw.{s}"
        row = {"bytes": s, "iters": iters(s),
               "copy_s": median_time(device_copy_fn(cupy, x, y), iters(s), comm=comm),
               "horolite_s": median_time(lambda: hvd.allreduce(x, op=hvd.Sum, name=name),
                                         iters(s), comm=comm)}
        row["copy_over_horolite"] = row["copy_s"] / row["horolite_s"]
        row["overhead_us"] = (row["horolite_s"] - row["copy_s"]) * 1e6
        rows.append(row)
    return rows


def staged_rows(hvd, cupy, comm, sizes, iters):
    import cupyx
    rows = []
    for s in sizes:
        x = cupy.full(s // 4, 1.0, dtype=cupy.float32)
        pinned = cupyx.empty_pinned(x.shape, x.dtype)
        host = np.full(s // 4, 1.0, dtype=np.float32)

        def d2h():
            x.get(out=pinned)

        def h2d():
            cupy.asarray(host)
            cupy.cuda.get_current_stream().synchronize()
        it = iters(s)
        row = {"bytes": s, "iters": it,
               "staged_s": median_time(lambda: hvd.allreduce(x, op=hvd.Sum, name=f"st.{s}"),
                                       it, comm=comm),
               "host_s": median_time(lambda: hvd.allreduce(host, op=hvd.Sum, name=f"h.{s}"),
                                     it, comm=comm),
               "d2h_s": median_time(d2h, it, comm=comm),
               "h2d_s": median_time(h2d, it, comm=comm)}
        row["host_plus_copies_s"] = row["host_s"] + row["d2h_s"] + row["h2d_s"]
        row["staged_over_host_plus_copies"] = row["staged_s"] / row["host_plus_copies_s"]
        rows.append(row)
    return rows


def main(argv=None) -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=None)
    p.add_argument("--budget-mib", type=int, default=4096)
    args = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    why = comm.allgather(skip_reason())
    if any(why):
        if comm.Get_rank() == 0:
            print(f"gpu_allreduce skipped: {next(w for w in why if w)}", flush=True)
        return
    import cupy

    import horolite as hvd
    sizes = args.sizes or (TINY_SIZES if args.tiny else DEFAULT_SIZES)
    lo, hi = (3, 10) if args.tiny else (20, 500)

    def iters(nbytes):
        return int(min(hi, max(lo, args.budget_mib * MiB // nbytes)))

    hvd.init()
    rt = hvd.api.basics.runtime()
    cupy.cuda.Device(rt.nccl.device_id if rt.nccl else 0).use()
    gpu = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    mode = "nccl" if rt.nccl is not None else "staged"
    rows = (nccl_rows if mode == "nccl" else staged_rows)(hvd, cupy, comm, sizes, iters)
    hvd.shutdown()

    targets = []
    if mode == "nccl":
        columns = ["size", "horolite ms", "copy ms", "copy / horolite", "overhead us"]
        table = [[human_bytes(r["bytes"]), f"{r['horolite_s'] * 1e3:.3f}",
                  f"{r['copy_s'] * 1e3:.3f}", f"{r['copy_over_horolite']:.2f}",
                  f"{r['overhead_us']:.0f}"] for r in rows]
        for r in rows:
            if r["bytes"] >= 64 * MiB:
                targets.append(Target(f"{human_bytes(r['bytes'])}: copy time / horolite time",
                                      r["copy_over_horolite"], 0.9, "x", True,
                                      "not yet profiled on a GPU"))
        small = rows[0]
        targets.append(Target(f"{human_bytes(small['bytes'])}: horolite's own time per call",
                              small["overhead_us"], 50.0, "us", False, "not yet profiled on a GPU"))
    else:
        columns = ["size", "staged ms", "host ms", "D2H ms", "H2D ms", "staged / (host+copies)"]
        table = [[human_bytes(r["bytes"]), f"{r['staged_s'] * 1e3:.3f}", f"{r['host_s'] * 1e3:.3f}",
                  f"{r['d2h_s'] * 1e3:.3f}", f"{r['h2d_s'] * 1e3:.3f}",
                  f"{r['staged_over_host_plus_copies']:.2f}"] for r in rows]
        for r in rows:
            if r["bytes"] >= 4 * MiB:
                targets.append(Target(f"{human_bytes(r['bytes'])} staged: time / (host path + "
                                      "the two copies)", r["staged_over_host_plus_copies"], 1.1,
                                      "x", False, "not yet profiled on a GPU"))
    common.finish(comm, args, "gpu_allreduce",
                  {"mode": mode, "gpu": gpu, "nccl": rt.nccl_reason, "sizes": sizes, "rows": rows},
                  columns, table, targets)


if __name__ == "__main__":
    sys.exit(main())
