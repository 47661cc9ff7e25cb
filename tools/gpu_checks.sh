#!/usr/bin/env bash
# Every GPU check of horolite in one command, on a machine with a GPU and no network.
#
#   tools/gpu_checks.sh --download-wheels DIR   # on a machine with network: fetch the wheels
#   tools/gpu_checks.sh [DIR]                   # on the GPU machine, from a checkout (DIR: ./gpu-wheels)
#
# The GPU machine's python must already have NumPy, and CuPy with NCCL (cupy-cuda12x or
# cupy-cuda13x) unless their wheels are put in DIR too; DIR brings what horolite adds (MPICH,
# mpi4py, cffi, pycparser, PyYAML, and what builds and tests it): every wheel in DIR is installed. Nothing is fetched: pip runs with
# --no-index. A virtual environment (.venv-gpu, seeing the system's packages) holds it.
#
# Steps: the install, `horolite-run --check-build`, the GPU path's unit tests, the GPU matrix
# at np 1-4 (tests/test_matrix_gpu.py: NCCL with the test-only shared-GPU switch, and as users
# run it: staged through host memory when ranks share a GPU), bench/gpu_allreduce.py at np 1
# (NCCL vs a device copy) and np 2 (staged vs host + copies). Logs and benchmark results go
# to $OUT (default ./gpu-checks-out). Exit status: the number of failed steps.
set -uo pipefail
cd "$(dirname "$0")/.."

PYVER=${PYVER:-3.12}
# A manylinux_2_28 machine runs wheels tagged for it or any older manylinux; some pip versions
# match --platform exactly, so each tag is named (mpi4py, for one, ships manylinux_2_5 wheels).
PLATFORMS=${PLATFORMS:-"manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
manylinux_2_12_x86_64 manylinux2010_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64"}
# What horolite and its tests add to a python that has CuPy, NCCL and NumPy (setuptools and
# wheel build the editable install; pytest and its dependencies run the checks).
WHEELS_FOR_HOROLITE="mpich mpi4py cffi pycparser pyyaml setuptools wheel pytest iniconfig
pluggy packaging pygments ml_dtypes"

if [ "${1:-}" = "--download-wheels" ]; then
    dir=${2:?usage: tools/gpu_checks.sh --download-wheels DIR}
    platforms=()
    for p in $PLATFORMS; do platforms+=(--platform "$p"); done
    exec python3 -m pip download --no-deps --only-binary=:all: --python-version "$PYVER" \
        "${platforms[@]}" -d "$dir" $WHEELS_FOR_HOROLITE
fi

WHEELS=$(realpath "${1:-gpu-wheels}")
OUT=$(realpath -m "${OUT:-gpu-checks-out}")
mkdir -p "$OUT"
failed=0
step() {  # step NAME COMMAND...: run it, log to $OUT/NAME.log, say how it went
    local name=$1; shift
    echo "== $name: $*"
    if "$@" >"$OUT/$name.log" 2>&1; then
        echo "   ok ($name.log)"
    else
        echo "   FAILED (exit $?): last lines of $OUT/$name.log:"
        tail -n 25 "$OUT/$name.log" | sed 's/^/   | /'
        failed=$((failed + 1))
    fi
}

if ! nvidia-smi -L >"$OUT/nvidia-smi.log" 2>&1; then
    echo "no GPU here (nvidia-smi -L failed; see $OUT/nvidia-smi.log)"; exit 100
fi
cat "$OUT/nvidia-smi.log"
[ -d "$WHEELS" ] || { echo "no wheel folder $WHEELS (make it with --download-wheels)"; exit 101; }

install() {
    [ -x .venv-gpu/bin/python ] || python3 -m venv --system-site-packages .venv-gpu || return 1
    # Every wheel brought along, as it is (--no-deps: nothing to resolve without an index).
    .venv-gpu/bin/python -m pip install --no-index --no-deps "$WHEELS"/*.whl || return 1
    .venv-gpu/bin/python -m pip install --no-index --no-deps --no-build-isolation -e . || return 1
    .venv-gpu/bin/python -m pip check || true
    .venv-gpu/bin/python -c "import cupy, horolite; print('CuPy', cupy.__version__, 'sees', cupy.cuda.runtime.getDeviceCount(), 'GPU(s)')"
}
step install install
export PATH="$PWD/.venv-gpu/bin:$PATH"
PY=.venv-gpu/bin/python
step check-build horolite-run --check-build
step unit timeout 900 "$PY" -m pytest -q -rs tests/unit/core/test_device.py \
    tests/unit/core/test_staging.py tests/unit/core/test_cuda_info.py tests/unit/api \
    tests/unit/tensorflow
step gpu-matrix timeout 3000 "$PY" -m pytest -v -rs tests/test_matrix_gpu.py
step bench-script timeout 600 "$PY" -m pytest -q -rs tests/test_bench_scripts.py -k gpu
step bench-np1-nccl timeout 900 horolite-run -np 1 "$PY" bench/gpu_allreduce.py \
    --out "$OUT/gpu_allreduce_np1.json"
step bench-np2-staged timeout 900 horolite-run -np 2 "$PY" bench/gpu_allreduce.py \
    --out "$OUT/gpu_allreduce_np2.json"
grep -h -A 20 "^| size" "$OUT"/bench-np*.log 2>/dev/null
echo "== $failed step(s) failed; logs in $OUT"
exit "$failed"
