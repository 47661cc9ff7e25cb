"""The device side's own CUDA kernels: gather many members into one buffer in one launch.

A fused device collective must not pay a CUDA call per member from Python (about
5 us each through CuPy). One kernel launch reads a table of members (source
pointer, start and length in the destination, in units) and writes them all into
one buffer, scaling on the way where asked; a block handles a fixed chunk of the
destination and finds its first member by binary search, so members of any sizes
share the GPU evenly. A null source pointer writes zeros (a joined rank's part).

Scaling follows the host path's rules (native/kernels.c): float16 computes in
float32, integers in double, truncated toward zero and saturated to the dtype.
Copies move 1, 2, 4, 8 or 16 bytes a unit, the widest every member allows.

The source compiles with NVRTC, which needs no GPU (`compile_ptx`, tested for
sm_80 and sm_90); on a GPU, CuPy's RawModule compiles it once per device. CuPy
is imported only when a kernel is first needed.
"""
from __future__ import annotations

import threading
from typing import Dict

__all__ = ["SOURCE", "CHUNK_UNITS", "THREADS", "COPY_UNITS", "SCALED_DTYPES", "copy_kernel",
           "scale_kernel", "inplace_kernel", "blocks_for", "compile_ptx", "function"]

CHUNK_UNITS = 4096  # destination units per block
THREADS = 256
COPY_UNITS = (16, 8, 4, 2, 1)
# dtype -> (C type, how one value is scaled)
SCALED_DTYPES = {
    "uint8": ("unsigned char", "INT"), "int8": ("signed char", "INT"),
    "uint16": ("unsigned short", "INT"), "int16": ("short", "INT"),
    "int32": ("int", "INT"), "int64": ("long long", "INT"),
    "float16": ("unsigned short", "HALF"), "float32": ("float", "FLOAT"),
    "float64": ("double", "DOUBLE"),
}
_LIMITS = {"uint8": (0, 255), "int8": (-128, 127), "uint16": (0, 65535), "int16": (-32768, 32767),
           "int32": (-2147483648, 2147483647),
           # (long long)(double) saturates in PTX: 2^63 as a double becomes INT64_MAX
           "int64": (-9223372036854775808, 9223372036854775807)}

_COMMON = r"""
typedef long long i64;
typedef unsigned long long u64;

// The last member whose start is <= at (members are in order of start).
__device__ __forceinline__ int hl_first(const i64* start, int n, i64 at) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (start[mid] <= at) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// table: n source pointers, then n starts and n lengths in dst, in units of T.
template <class T, class Op>
__device__ __forceinline__ void hl_gather(const i64* table, int n, T* dst, Op op) {
  const i64 begin = (i64)blockIdx.x * %(chunk)d, end = begin + %(chunk)d;
  const i64* start = table + n;
  const i64* count = table + 2 * n;
  for (int m = hl_first(start, n, begin); m < n && start[m] < end; ++m) {
    const i64 lo = start[m] > begin ? start[m] : begin;
    const i64 stop = start[m] + count[m];
    const i64 hi = stop < end ? stop : end;
    if (table[m]) {
      const T* src = (const T*)table[m] - start[m];
      for (i64 i = lo + threadIdx.x; i < hi; i += blockDim.x) dst[i] = op(src[i]);
    } else {
      for (i64 i = lo + threadIdx.x; i < hi; i += blockDim.x) dst[i] = T();
    }
  }
}

template <class T> struct hl_same { __device__ T operator()(T x) const { return x; } };

struct hl_float {
  float f;
  __device__ float operator()(float x) const { return x * f; }
};
struct hl_double {
  double f;
  __device__ double operator()(double x) const { return x * f; }
};
struct hl_half {  // IEEE half as bits: computed in float32, rounded to nearest even
  float f;
  __device__ unsigned short operator()(unsigned short h) const {
    float x;
    asm("cvt.f32.f16 %%0, %%1;" : "=f"(x) : "h"(h));
    x *= f;
    unsigned short r;
    asm("cvt.rn.f16.f32 %%0, %%1;" : "=h"(r) : "f"(x));
    return r;
  }
};
template <class T> struct hl_int {  // in double, toward zero, saturated
  double f, lo, hi;
  __device__ T operator()(T x) const {
    double v = trunc((double)x * f);
    v = v < lo ? lo : (v > hi ? hi : v);
    return (T)v;
  }
};
"""

_COPY = r"""
extern "C" __global__ void hl_copy_%(unit)d(const i64* table, int n, %(ctype)s* dst) {
  hl_gather(table, n, dst, hl_same<%(ctype)s>());
}
"""

_SCALE = r"""
extern "C" __global__ void hl_scale_%(name)s(const i64* table, int n, %(ctype)s* dst, double f) {
  hl_gather(table, n, dst, %(op)s);
}
extern "C" __global__ void hl_inplace_%(name)s(%(ctype)s* buf, i64 count, double f) {
  const %(optype)s op = %(op)s;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += (i64)gridDim.x * blockDim.x)
    buf[i] = op(buf[i]);
}
"""

_COPY_TYPES = {16: "uint4", 8: "unsigned long long", 4: "unsigned int", 2: "unsigned short",
               1: "unsigned char"}


def _scale_op(name: str):
    ctype, how = SCALED_DTYPES[name]
    if how == "INT":
        lo, hi = _LIMITS[name]
        return f"hl_int<{ctype}>", f"hl_int<{ctype}>{{f, {float(lo)!r}, {float(hi)!r}}}"
    optype = {"HALF": "hl_half", "FLOAT": "hl_float", "DOUBLE": "hl_double"}[how]
    return optype, f"{optype}{{({'double' if how == 'DOUBLE' else 'float'})f}}"


def _source() -> str:
    parts = [_COMMON % {"chunk": CHUNK_UNITS}]
    parts += [_COPY % {"unit": u, "ctype": _COPY_TYPES[u]} for u in COPY_UNITS]
    for name, (ctype, _) in SCALED_DTYPES.items():
        optype, op = _scale_op(name)
        parts.append(_SCALE % {"name": name, "ctype": ctype, "op": op, "optype": optype})
    return "".join(parts)


SOURCE = _source()


def copy_kernel(unit: int) -> str:
    return f"hl_copy_{unit}"


def scale_kernel(dtype_name: str) -> str:
    return f"hl_scale_{dtype_name}"


def inplace_kernel(dtype_name: str) -> str:
    return f"hl_inplace_{dtype_name}"


def blocks_for(total_units: int) -> int:
    """Blocks of a gather launch over a destination of `total_units`."""
    return max(1, -(-int(total_units) // CHUNK_UNITS))


def compile_ptx(arch: int = 90) -> str:
    """PTX of SOURCE for compute_`arch`, through NVRTC alone (no GPU, no driver).

    Raises what NVRTC says when the source does not compile.
    """
    from cupy_backends.cuda.libs import nvrtc
    prog = nvrtc.createProgram(SOURCE, "horolite_device_kernels.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [f"--gpu-architecture=compute_{arch}"])
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(f"{exc}\n{nvrtc.getProgramLog(prog)}") from None
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return ptx.decode() if isinstance(ptx, bytes) else ptx


_modules: Dict[int, object] = {}
_functions: Dict[tuple, object] = {}
_lock = threading.Lock()


def function(name: str, device_id: int):
    """The compiled kernel `name` on `device_id` (compiled there on first use)."""
    fn = _functions.get((name, device_id))
    if fn is None:
        import cupy
        with _lock:
            module = _modules.get(device_id)
            if module is None:
                with cupy.cuda.Device(device_id):
                    module = _modules[device_id] = cupy.RawModule(code=SOURCE)
            with cupy.cuda.Device(device_id):
                fn = _functions[(name, device_id)] = module.get_function(name)
    return fn
