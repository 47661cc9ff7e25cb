"""The device kernels' source compiles, through NVRTC alone (no GPU, no driver needed).

CI installs cupy-cuda12x and nvidia-cuda-nvrtc-cu12 (.ci/run); where CuPy is installed
without NVRTC this fails, naming the wheel. Running the kernels is tools/gpu_checks.sh's.
"""
import re

import pytest

pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="cupy not installed")

from horolite.core import device_kernels as k  # noqa: E402


def expected_entries():
    return sorted([k.copy_kernel(u) for u in k.COPY_UNITS] +
                  [k.scale_kernel(d) for d in k.SCALED_DTYPES] +
                  [k.inplace_kernel(d) for d in k.SCALED_DTYPES])


@pytest.mark.parametrize("arch", [80, 90])
def test_the_kernels_compile_for(arch):
    try:
        ptx = k.compile_ptx(arch)
    except Exception as exc:
        if "libnvrtc" in str(exc):
            pytest.fail(f"NVRTC not found: pip install nvidia-cuda-nvrtc-cu12 ({exc})")
        raise
    assert f".target sm_{arch}" in ptx
    assert sorted(re.findall(r"\.entry (\w+)\(", ptx)) == expected_entries()


def test_a_source_error_is_reported_with_nvrtc_log(monkeypatch):
    monkeypatch.setattr(k, "SOURCE", k.SOURCE + "\nthis is not CUDA;\n")
    with pytest.raises(RuntimeError, match="error"):
        k.compile_ptx(90)


def test_launch_geometry():
    assert k.blocks_for(0) == 1 and k.blocks_for(1) == 1
    assert k.blocks_for(k.CHUNK_UNITS) == 1 and k.blocks_for(k.CHUNK_UNITS + 1) == 2
