"""Which CUDA stack this installation has: the CuPy and NCCL wheels, and the driver.

CuPy and NCCL come as wheels built for one CUDA major version (horolite's
extras `cuda12` and `cuda13`, see docs/gpus.md), and a driver runs what was
built for its own major version or an older one. A wheel for a newer CUDA
than the driver's makes NCCL fail to load with a message that does not say
so; `horolite-run --check-build` prints this module's line to make that
visible. Nothing here needs a GPU or imports CuPy: versions come from
package metadata and from the driver library through ctypes.
"""
from __future__ import annotations

import ctypes
import re
from importlib import metadata
from typing import List, Optional, Sequence, Tuple

__all__ = ["CUPY_PACKAGES", "NCCL_PACKAGES", "installed", "driver_cuda_version", "cuda_major",
           "version_text", "describe", "cuda_stack"]

CUPY_PACKAGES = ("cupy-cuda13x", "cupy-cuda12x", "cupy-cuda11x", "cupy")
NCCL_PACKAGES = ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11")


def installed(names: Sequence[str]) -> List[Tuple[str, str]]:
    """(name, version) of each of these distributions that is installed."""
    found = []
    for name in names:
        try:
            found.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            continue
    return found


def driver_cuda_version() -> Optional[int]:
    """The CUDA version the driver supports (e.g. 13000 for 13.0), or None without a driver."""
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        version = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(version)) == 0 and version.value:
            return version.value
        return None
    return None


def cuda_major(package: str) -> Optional[int]:
    """The CUDA major version a wheel is built for, from its name (cupy-cuda12x: 12)."""
    match = re.search(r"(?:cuda|cu)(\d\d)x?$", package)
    return int(match.group(1)) if match else None


def version_text(version: int) -> str:
    """CUDA's integer encoding (1000 * major + 10 * minor) as text: 12040 -> "12.4"."""
    return f"{version // 1000}.{version % 1000 // 10}"


def describe(cupy: Sequence[Tuple[str, str]], nccl: Sequence[Tuple[str, str]],
             driver: Optional[int]) -> str:
    """One line: the driver's CUDA, the CuPy and NCCL wheels, and what does not fit.

    Pure: the inputs are what `installed` and `driver_cuda_version` found.
    """
    parts = [f"CUDA driver {version_text(driver)}" if driver else "no CUDA driver"]
    parts.append(", ".join(f"{n} {v}" for n, v in cupy) if cupy else "CuPy not installed")
    parts.append(", ".join(f"{n} {v}" for n, v in nccl) if nccl else "no NCCL wheel")
    problems = []
    if len(cupy) > 1:
        problems.append("more than one CuPy is installed: keep one (pip uninstall the others)")
    if len(nccl) > 1:
        problems.append("more than one NCCL wheel is installed: keep the one of your CuPy's CUDA")
    majors = {cuda_major(n) for n, _ in list(cupy) + list(nccl)} - {None}
    if len(majors) > 1:
        problems.append(f"CuPy and NCCL are built for different CUDA versions "
                        f"({', '.join(str(m) for m in sorted(majors))})")
    if driver and majors and max(majors) > driver // 1000:
        fits = driver // 1000
        problems.append(f"the driver supports CUDA {version_text(driver)} but a wheel needs CUDA "
                        f"{max(majors)}: install horolite[cuda{fits}] instead" if fits >= 12 else
                        f"the driver supports CUDA {version_text(driver)} but a wheel needs CUDA "
                        f"{max(majors)}: update the driver")
    return "; ".join(parts + problems)


def cuda_stack() -> str:
    """`describe` of this installation."""
    return describe(installed(CUPY_PACKAGES), installed(NCCL_PACKAGES), driver_cuda_version())
