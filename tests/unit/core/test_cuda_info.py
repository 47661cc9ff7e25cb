"""The CUDA stack line of `--check-build` (horolite/core/cuda_info.py): no GPU needed."""
import importlib.util

import pytest

from horolite.core import cuda_info


@pytest.mark.parametrize("name,major", [("cupy-cuda12x", 12), ("cupy-cuda13x", 13),
                                        ("nvidia-nccl-cu12", 12), ("nvidia-nccl-cu13", 13),
                                        ("cupy", None)])
def test_cuda_major_from_the_wheel_name(name, major):
    assert cuda_info.cuda_major(name) == major


def test_version_text():
    assert cuda_info.version_text(12040) == "12.4"
    assert cuda_info.version_text(13000) == "13.0"
    assert cuda_info.version_text(12080) == "12.8"


def test_a_matching_cuda13_stack():
    line = cuda_info.describe([("cupy-cuda13x", "14.2.0")], [("nvidia-nccl-cu13", "2.28.9")], 13000)
    assert line == "CUDA driver 13.0; cupy-cuda13x 14.2.0; nvidia-nccl-cu13 2.28.9"


def test_a_cuda12_stack_runs_on_a_cuda13_driver():
    line = cuda_info.describe([("cupy-cuda12x", "14.2.0")], [("nvidia-nccl-cu12", "2.28.9")], 13000)
    assert line == "CUDA driver 13.0; cupy-cuda12x 14.2.0; nvidia-nccl-cu12 2.28.9"


def test_wheels_newer_than_the_driver_name_the_extra_to_install():
    line = cuda_info.describe([("cupy-cuda13x", "14.2.0")], [("nvidia-nccl-cu13", "2.28.9")], 12040)
    assert line.endswith("the driver supports CUDA 12.4 but a wheel needs CUDA 13: "
                         "install horolite[cuda12] instead")


def test_mixed_and_doubled_wheels_are_named():
    line = cuda_info.describe([("cupy-cuda13x", "14.2.0"), ("cupy-cuda12x", "14.2.0")],
                              [("nvidia-nccl-cu12", "2.28.9")], None)
    assert line.startswith("no CUDA driver; cupy-cuda13x 14.2.0, cupy-cuda12x 14.2.0; "
                           "nvidia-nccl-cu12 2.28.9; ")
    assert "more than one CuPy is installed" in line
    assert "built for different CUDA versions (12, 13)" in line


def test_nothing_installed():
    assert cuda_info.describe([], [], None) == "no CUDA driver; CuPy not installed; no NCCL wheel"


def test_this_installation():
    """What this machine has, read for real (no driver on a CPU machine)."""
    line = cuda_info.cuda_stack()
    assert ("CuPy not installed" in line) == (importlib.util.find_spec("cupy") is None)
    driver = cuda_info.driver_cuda_version()
    assert line.startswith(f"CUDA driver {cuda_info.version_text(driver)}" if driver
                           else "no CUDA driver")
