"""Bandwidth of the native reduce kernel against NumPy's add.

    python bench/kernels_bandwidth.py [--mib 64] [--repeat 10]

For float32, float16 and bfloat16 arrays of --mib MiB each, times
`hl_reduce(a, b, SUM)` (through horolite.core.kernels.reduce_into, on every
instruction-set level this CPU runs) and `numpy.add(a, b, out=a)`, and prints
GB/s counting the bytes moved (read a, read b, write a = 3x the array size),
best of --repeat runs. The float16/bfloat16 NumPy numbers are NumPy's own
arithmetic in those dtypes, not the float32-accumulating kernel.
"""
import argparse
import os
import sys
import time

import ml_dtypes
import numpy as np

try:
    import horolite  # noqa: F401  (installed)
except ImportError:  # a source checkout built with `python native/build_native.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from horolite.core import kernels
from horolite._native import ffi, lib
from horolite.core.ops import ReduceOp


def best_seconds(fn, repeat):
    fn()  # warm up: page faults, caches
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="size of each array in MiB")
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args(argv)
    nbytes = args.mib << 20
    levels = [lv for lv in range(4) if lib.hl_isa_name(lv) != ffi.NULL]
    names = {lv: ffi.string(lib.hl_isa_name(lv)).decode() for lv in levels}
    default = lib.hl_isa_get()
    print(f"arrays of {args.mib} MiB; GB/s = 3 x array bytes / best time of {args.repeat}")
    print(f"{'dtype':10} {'kernel':>12} {'GB/s':>8} {'numpy GB/s':>11} {'ratio':>7}")
    rng = np.random.default_rng(0)
    try:
        for dtype in (np.float32, np.float16, ml_dtypes.bfloat16):
            dt = np.dtype(dtype)
            n = nbytes // dt.itemsize
            a = rng.standard_normal(n, dtype=np.float32).astype(dt)
            b = rng.standard_normal(n, dtype=np.float32).astype(dt)
            # keep values bounded over repeated sums: b is tiny next to a
            b *= dt.type(1e-3)
            t_np = best_seconds(lambda: np.add(a, b, out=a), args.repeat)
            np_gbs = 3 * nbytes / t_np / 1e9
            for lv in levels:
                lib.hl_isa_set(lv)
                t = best_seconds(lambda: kernels.reduce_into(a, b, ReduceOp.SUM), args.repeat)
                gbs = 3 * nbytes / t / 1e9
                print(f"{dt.name:10} {names[lv]:>12} {gbs:8.2f} {np_gbs:11.2f} "
                      f"{gbs / np_gbs:6.2f}x")
    finally:
        lib.hl_isa_set(default)


if __name__ == "__main__":
    main()
