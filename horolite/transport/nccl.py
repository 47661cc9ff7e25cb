"""The NCCL transport: the same data-plane methods as MPITransport, on CuPy arrays.

Negotiation stays on MPI; only tensor bytes move here. One communicator and
one CUDA stream per process set: every call is enqueued on that stream, in the
order the (identical) response list gives, and returns once the stream's work
is done. Buffers are 1-D CuPy arrays on this rank's device; byte buffers are
uint8, reduction buffers carry their dtype.

The communicator is made at init: rank 0 asks NCCL for a unique id and
`exchange_unique_id` broadcasts its 128 bytes over MPI. That function needs no
GPU and is tested for real (tests/parallel/test_gpu.py).

CuPy is imported only when a transport is built (that is, when a GPU is present);
this module does not import mpi4py either: it works on the communicator it is given.
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import TYPE_CHECKING, Optional, Sequence, Tuple

import numpy as np

from ..core import device as device_mod
from ..core import device_kernels
from ..core.ops import ReduceOp
from .shared_gpu_switch import SHARED_GPU_TEST_SWITCH, shared_gpu_host_id, shared_gpu_test_switch

if TYPE_CHECKING:  # annotations only: importing mpi4py.MPI would start MPI
    from mpi4py import MPI

__all__ = ["NCCL_UNIQUE_ID_BYTES", "exchange_unique_id", "unique_id_to_bytes", "NCCLTransport",
           "create_nccl_transport", "decide_nccl", "device_scale", "device_copy", "RS_AG_MIN_BYTES",
           "SHARED_GPU_TEST_SWITCH", "shared_gpu_test_switch", "shared_gpu_host_id"]

_log = logging.getLogger("horolite.nccl")

NCCL_UNIQUE_ID_BYTES = 128

# Allreduce of a buffer at least this big, with a postscale (Average, or a user
# factor), and a length divisible by the rank count runs as reduceScatter ->
# scale this rank's segment -> allGather, so the scaling touches 1/n of the
# buffer; otherwise allReduce (NCCL may pick tree or NVLS algorithms for it)
# then one scaling pass. Not tuned on hardware yet.
RS_AG_MIN_BYTES = 8 << 20


# ---- the unique id, over MPI ----
def unique_id_to_bytes(unique_id) -> bytes:
    """NCCL ids as bytes: CuPy >= 13 returns bytes, older CuPy a tuple of 128 signed chars."""
    if isinstance(unique_id, (bytes, bytearray, memoryview)):
        data = bytes(unique_id)
    else:
        data = bytes((int(c) & 0xFF) for c in unique_id)
    if len(data) != NCCL_UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id is {NCCL_UNIQUE_ID_BYTES} bytes, got {len(data)}")
    return data


def _communicator(nccl, size: int, data: bytes, rank: int):
    """ncclCommInitRank through CuPy, which takes the id as bytes (CuPy >= 13) or a tuple."""
    try:
        return nccl.NcclCommunicator(size, data, rank)
    except TypeError:  # older CuPy: a tuple of 128 signed chars
        return nccl.NcclCommunicator(size, tuple(b - 256 if b > 127 else b for b in data), rank)


def exchange_unique_id(unique_id, comm: MPI.Comm, root: int = 0) -> bytes:
    """Every rank of `comm` returns root's 128-byte NCCL id (other ranks pass None).

    One Bcast of 1 + 128 bytes, no pickling. The first byte says whether root
    had a valid id: if not, every rank raises the same error instead of
    waiting forever in NCCL's communicator set-up.
    """
    message = np.zeros(1 + NCCL_UNIQUE_ID_BYTES, dtype=np.uint8)
    problem = ""
    if comm.Get_rank() == root:
        try:
            if unique_id is None:
                raise ValueError("ncclGetUniqueId gave no id")
            message[1:] = np.frombuffer(unique_id_to_bytes(unique_id), dtype=np.uint8)
            message[0] = 1
        except (TypeError, ValueError) as exc:
            problem = str(exc)
    comm.Bcast(message, root=root)
    if not message[0]:
        raise RuntimeError(f"rank {root} had no valid NCCL unique id to share"
                           + (f": {problem}" if problem else ""))
    return message[1:].tobytes()


# ---- device kernels the executor and transport share ----
def device_scale(buf, factor: float, stream=None) -> None:
    """buf *= factor in place, one launch on `stream` (default: the current one), with the
    host path's rounding: float16 computes in float32; integers compute in double, truncate
    toward zero and saturate to the dtype's range (core/device_kernels.py)."""
    if factor == 1.0 or buf.size == 0:
        return
    import cupy
    fn = device_kernels.function(device_kernels.inplace_kernel(buf.dtype.name), buf.device.id)
    stream = stream or cupy.cuda.get_current_stream()
    blocks = min(-(-buf.size // device_kernels.THREADS), 65535)
    fn((blocks,), (device_kernels.THREADS,), (buf, np.int64(buf.size), np.float64(factor)),
       stream=stream)


def device_copy(dst, src, nbytes: Optional[int] = None, stream=None) -> None:
    """Copy the bytes of contiguous `src` to the start of contiguous `dst` (async on `stream`)."""
    import cupy
    nbytes = src.nbytes if nbytes is None else nbytes
    if nbytes == 0:
        return
    stream = stream or cupy.cuda.get_current_stream()
    cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes,
                                  cupy.cuda.runtime.memcpyDeviceToDevice, stream.ptr)


# ---- the transport ----
def _nccl_types():
    from cupy.cuda import nccl
    types = {"uint8": nccl.NCCL_UINT8, "int8": nccl.NCCL_INT8, "int32": nccl.NCCL_INT32,
             "int64": nccl.NCCL_INT64, "float16": nccl.NCCL_FLOAT16,
             "float32": nccl.NCCL_FLOAT32, "float64": nccl.NCCL_FLOAT64}
    if hasattr(nccl, "NCCL_BFLOAT16"):  # NCCL >= 2.10
        types["bfloat16"] = nccl.NCCL_BFLOAT16
    ops = {ReduceOp.SUM: nccl.NCCL_SUM, ReduceOp.AVERAGE: nccl.NCCL_SUM,  # 1/n is in postscale
           ReduceOp.MIN: nccl.NCCL_MIN, ReduceOp.MAX: nccl.NCCL_MAX,
           ReduceOp.PRODUCT: nccl.NCCL_PROD}
    return nccl, types, ops


class NCCLTransport:
    """Device-memory collectives over one NCCL communicator and one CUDA stream."""

    device = device_mod.CUDA

    def __init__(self, comm: MPI.Comm, device_id: int):
        import cupy
        self._cupy = cupy
        self._nccl, self._types, self._ops = _nccl_types()
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.device_id = device_id
        self.meta_comm = comm.Dup()  # host-side metadata of alltoall (the receive counts)
        self._scratch = None
        with cupy.cuda.Device(device_id):
            uid = None
            if self.rank == 0:
                try:
                    uid = self._nccl.get_unique_id()
                except Exception as exc:  # still take part in the exchange, which then fails everywhere
                    _log.error("rank 0: ncclGetUniqueId failed: %s", exc)
            data = exchange_unique_id(uid, self.meta_comm)
            self.comm = _communicator(self._nccl, self.size, data, self.rank)
            # Non-blocking: ordered after callers' work through the ready events the
            # collectives record at submit, not through the legacy default stream.
            self.stream = cupy.cuda.Stream(non_blocking=True)

    @contextlib.contextmanager
    def activate(self):
        """This rank's device current and the transport's stream current (per thread)."""
        with self._cupy.cuda.Device(self.device_id), self.stream:
            yield self.stream

    def _dtype(self, buf) -> int:
        name = buf.dtype.name
        try:
            return self._types[name]
        except KeyError:
            raise TypeError(f"NCCL does not reduce dtype {name}") from None

    def _finish(self) -> None:
        self.stream.synchronize()
        self.comm.check_async_error()

    def _scratch_for(self, nbytes: int):
        if self._scratch is None or self._scratch.nbytes < nbytes:
            with self._cupy.cuda.Device(self.device_id):
                self._scratch = self._cupy.empty(max(nbytes, 2 * (0 if self._scratch is None
                                                                  else self._scratch.nbytes)),
                                                 dtype=self._cupy.uint8)
        return self._scratch

    def finish(self) -> None:
        """Wait for everything enqueued on the stream; raise NCCL's asynchronous error."""
        self._finish()

    # ---- enqueued only: the caller activates, and finishes once for a whole batch ----
    def enqueue_allreduce(self, src, dst, op, postscale: float) -> None:
        """dst = the reduction of the typed 1-D `src` over all ranks, scaled by `postscale`
        (src may be dst: in place). Out of place, a single tensor goes straight from its
        input into its result."""
        n, count, stream = self.size, dst.size, self.stream
        if count == 0:
            return
        if n > 1:
            dt, nop = self._dtype(dst), self._ops[ReduceOp(op)]
            if postscale != 1.0 and count % n == 0 and dst.nbytes >= RS_AG_MIN_BYTES:
                seg = count // n
                mine = dst[self.rank * seg:(self.rank + 1) * seg]
                self.comm.reduceScatter(src.data.ptr, mine.data.ptr, seg, dt, nop, stream.ptr)
                device_scale(mine, postscale, stream)
                self.comm.allGather(mine.data.ptr, dst.data.ptr, seg, dt, stream.ptr)
                return
            self.comm.allReduce(src.data.ptr, dst.data.ptr, count, dt, nop, stream.ptr)
        elif src.data.ptr != dst.data.ptr:
            device_copy(dst, src, stream=stream)
        device_scale(dst, postscale, stream)

    def enqueue_allgather(self, buf, segment: int) -> None:
        """Equal segments of `segment` bytes: this rank's, at rank * segment, to every rank."""
        if self.size > 1 and segment:
            base = buf.data.ptr
            self.comm.allGather(base + self.rank * segment, base, segment, self._nccl.NCCL_UINT8,
                                self.stream.ptr)

    def enqueue_broadcast(self, buf, root: int) -> None:
        if self.size > 1 and buf.nbytes:
            self.comm.bcast(buf.data.ptr, buf.nbytes, self._nccl.NCCL_UINT8, root, self.stream.ptr)

    def enqueue_reducescatter(self, send, recv, op, postscale: float) -> None:
        """recv (typed, one segment) = the reduction of segment `rank` of `send` (size segments)."""
        count = recv.size
        if count and self.size > 1:
            self.comm.reduceScatter(send.data.ptr, recv.data.ptr, count, self._dtype(recv),
                                    self._ops[ReduceOp(op)], self.stream.ptr)
        elif count and send.data.ptr != recv.data.ptr:
            device_copy(recv, send, recv.nbytes, stream=self.stream)
        device_scale(recv, postscale, self.stream)

    # ---- data plane ----
    def allreduce(self, buf, op, postscale: float) -> None:
        """Reduce the typed 1-D `buf` in place over all ranks, then scale it by `postscale`."""
        with self.activate():
            self.enqueue_allreduce(buf, buf, op, postscale)
            self._finish()

    def reducescatter(self, buf, bounds: Sequence[int], op, postscale: float) -> None:
        """Afterwards buf[bounds[rank]:bounds[rank + 1]] holds the reduction (scaled)."""
        n, r = self.size, self.rank
        with self.activate() as stream:
            mine = buf[bounds[r]:bounds[r + 1]]
            counts = [bounds[i + 1] - bounds[i] for i in range(n)]
            seg = max(counts)
            if n > 1 and seg:
                dt, nop = self._dtype(buf), self._ops[ReduceOp(op)]
                if all(c == seg for c in counts) and bounds[0] == 0:
                    self.comm.reduceScatter(buf.data.ptr, mine.data.ptr, seg, dt, nop, stream.ptr)
                else:
                    # NCCL wants equal parts: lay the parts out at a fixed stride, padded.
                    item = buf.itemsize
                    padded = self._scratch_for(n * seg * item)[:n * seg * item].view(buf.dtype)
                    for i in range(n):
                        device_copy(padded[i * seg:], buf[bounds[i]:bounds[i + 1]], stream=stream)
                    out = padded[r * seg:(r + 1) * seg]
                    self.comm.reduceScatter(padded.data.ptr, out.data.ptr, seg, dt, nop, stream.ptr)
                    device_copy(mine, out, counts[r] * item, stream=stream)
            device_scale(mine, postscale)
            self._finish()

    def allgather(self, buf, bounds: Sequence[int]) -> None:
        """buf is bytes; this rank's part already sits at bounds[rank]."""
        n = self.size
        if n == 1:
            return
        with self.activate() as stream:
            counts = [bounds[i + 1] - bounds[i] for i in range(n)]
            u8 = self._nccl.NCCL_UINT8
            base = buf.data.ptr
            if len(set(counts)) == 1 and bounds[0] == 0:
                if counts[0]:
                    self.comm.allGather(base + bounds[self.rank], base, counts[0], u8, stream.ptr)
            else:
                # Different sizes per rank: one broadcast from each rank, grouped into one launch.
                self._nccl.groupStart()
                try:
                    for i, c in enumerate(counts):
                        if c:
                            self.comm.broadcast(base + bounds[i], base + bounds[i], c, u8, i, stream.ptr)
                finally:
                    self._nccl.groupEnd()
            self._finish()

    def broadcast(self, buf, root: int) -> None:
        """buf (bytes) on every rank becomes root's."""
        if self.size == 1 or buf.nbytes == 0:
            return
        with self.activate() as stream:
            self.comm.bcast(buf.data.ptr, buf.nbytes, self._nccl.NCCL_UINT8, root, stream.ptr)
            self._finish()

    def alltoall(self, send, send_rows: np.ndarray, row_bytes: int) -> Tuple[object, np.ndarray]:
        """Rows to each rank from `send` (bytes); returns (received bytes, rows from each rank).

        The row counts are host metadata and cross on MPI; the rows cross on
        NCCL as grouped send/recv pairs.
        """
        n, r = self.size, self.rank
        send_rows = np.ascontiguousarray(send_rows, dtype=np.int64)
        recv_rows = np.empty(n, dtype=np.int64)
        self.meta_comm.Alltoall(send_rows, recv_rows)
        send_off = np.concatenate(([0], np.cumsum(send_rows))) * row_bytes
        recv_off = np.concatenate(([0], np.cumsum(recv_rows))) * row_bytes
        with self.activate() as stream:
            recv = self._cupy.empty(int(recv_off[-1]), dtype=self._cupy.uint8)
            u8 = self._nccl.NCCL_UINT8
            device_copy(recv[int(recv_off[r]):], send[int(send_off[r]):],
                        int(send_off[r + 1] - send_off[r]), stream=stream)
            if n > 1:
                self._nccl.groupStart()
                try:
                    for k in range(1, n):
                        dest, source = (r + k) % n, (r - k) % n
                        sbytes = int(send_off[dest + 1] - send_off[dest])
                        rbytes = int(recv_off[source + 1] - recv_off[source])
                        if sbytes:
                            self.comm.send(send.data.ptr + int(send_off[dest]), sbytes, u8, dest,
                                           stream.ptr)
                        if rbytes:
                            self.comm.recv(recv.data.ptr + int(recv_off[source]), rbytes, u8, source,
                                           stream.ptr)
                finally:
                    self._nccl.groupEnd()
            self._finish()
        return recv, recv_rows

    def close(self) -> None:
        try:
            self.comm.destroy()
        except Exception:  # already gone, or the job is tearing down
            pass
        try:
            self.meta_comm.Free()
        except Exception:  # MPI already finalized
            pass


def _gpu_identity(device_id: int) -> str:
    """The physical GPU behind an ordinal (ordinals differ under CUDA_VISIBLE_DEVICES)."""
    try:
        import cupy
        return cupy.cuda.runtime.deviceGetPCIBusId(device_id)
    except Exception:
        return f"ordinal {device_id} of CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}"


def decide_nccl(answers: Sequence[Tuple[bool, str, str, str]],
                allow_shared: bool = False) -> Tuple[bool, str]:
    """Whether the job uses NCCL, from every rank's (ok, reason, host, GPU identity).

    Pure, and run on every rank with the same answers, so all ranks agree. NCCL
    needs every rank to have a GPU, and one GPU per rank (unless `allow_shared`,
    the test switch, which every rank must have had on).
    """
    missing = [(r, why) for r, (good, why, _, _) in enumerate(answers) if not good]
    if missing and len(missing) == len(answers):
        reasons = {why for _, why in missing}
        return False, (reasons.pop() if len(reasons) == 1
                       else "; ".join(f"rank {r}: {w}" for r, w in missing))
    if missing:
        why = "; ".join(f"rank {r}: {w}" for r, w in missing)
        return False, f"not every rank can use NCCL ({why})"
    sharing = {}
    for r, (_, _, host, gpu) in enumerate(answers):
        sharing.setdefault((host, gpu), []).append(r)
    shared = [(host, gpu, ranks) for (host, gpu), ranks in sharing.items() if len(ranks) > 1]
    if shared and allow_shared:
        return True, f"{answers[0][1]} (test switch: ranks share a GPU, one NCCL host id each)"
    if shared:
        host, gpu, ranks = shared[0]
        return False, (f"ranks {', '.join(map(str, ranks))} on {host} would share one GPU ({gpu}); "
                       "NCCL needs one GPU per rank: give each rank its own device "
                       "(CUDA_VISIBLE_DEVICES or HOROLITE_GPU_DEVICE)")
    return True, answers[0][1]


def create_nccl_transport(comm: "MPI.Comm", local_rank: int) -> Tuple[Optional[NCCLTransport], str]:
    """Collective over `comm`: build the NCCL transport when every rank can, else (None, why).

    Each rank probes locally (device.nccl_status, which imports CuPy only when a
    driver with a device is there); one allgather of the answers decides for
    all (decide_nccl), so every rank takes the same branch and neither the id
    exchange nor NCCL's communicator set-up waits for a rank that is not coming.
    """
    from ..core.mpi_library import MPI
    host = MPI.Get_processor_name()
    switch = shared_gpu_test_switch()
    if switch:
        # Before this process's first NCCL call that could read it (NCCL may keep its host
        # hash once computed); a rank id of its own makes NCCL see the ranks as hosts.
        os.environ["NCCL_HOSTID"] = shared_gpu_host_id(host, MPI.COMM_WORLD.Get_rank())
    ok, reason = device_mod.nccl_status()
    device_id, gpu = -1, ""
    if ok:
        try:
            device_id = device_mod.device_for_rank(local_rank, device_mod.cuda_device_count())
            gpu = _gpu_identity(device_id)
        except ValueError as exc:
            ok, reason = False, str(exc)
    gathered = comm.allgather(((ok, reason, host, gpu), switch))
    answers = [answer for answer, _ in gathered]
    allow_shared = all(on for _, on in gathered)
    go, why = decide_nccl(answers, allow_shared)
    if not go:
        if comm.Get_rank() == 0 and any(answer[0] for answer in answers):
            # Some rank has a GPU, so someone may expect NCCL: say why it is off.
            _log.warning("NCCL is off for this job: %s; device arrays are staged through host "
                         "memory", why)
        return None, why
    if allow_shared:
        _log.warning("test switch %s=1: NCCL host id %s", SHARED_GPU_TEST_SWITCH,
                     os.environ["NCCL_HOSTID"])
    try:
        transport = NCCLTransport(comm, device_id)
    except Exception as exc:
        # ncclCommInitRank is collective; a rank failing here usually fails on every rank.
        _log.error("NCCL communicator set-up failed on rank %d (device %d): %s",
                   comm.Get_rank(), device_id, exc)
        return None, f"NCCL communicator set-up failed: {exc}"
    _log.info("NCCL up on cuda:%d (%s): %s", device_id, gpu, reason)
    return transport, reason
