#!/usr/bin/env bash
# Every GPU check of horolite in one command, on a machine with a GPU and no network.
# About 3-5 minutes on one H100 or H200; exit status 0 when nothing is wrong.
#
#   tools/gpu_checks.sh --download-wheels [DIR]   # where pip reaches PyPI (DIR: ./gpu-wheels)
#   tools/gpu_checks.sh [DIR]                     # on the GPU machine, from a checkout
#
# The GPU machine's python3 must have NumPy, pytest, setuptools, wheel and CuPy with NCCL
# (cupy-cuda12x or cupy-cuda13x). DIR brings what horolite adds: MPICH, mpi4py, cffi and
# pycparser (about 15 MB); every wheel in DIR is installed, with pip --no-index, with
# horolite itself (editable): into python3's environment when python3 is a virtual
# environment (as on the GPU machines lent here, which start bare each time), else into
# .venv-gpu, made to see the system's packages (VENV=1 or 0 to choose).
#
# Steps: the install, `horolite-run --check-build`, the GPU path's unit tests, the
# benchmarks (the GPU rows of bench/step_allreduce.py for ResNet-50 and BERT-base,
# bench/gpu_allreduce.py at np 1, NCCL against a device copy, and at np 2, staged against the
# host path plus two copies, bench/gpu_batch_python.py), then the GPU matrix
# (tests/test_matrix_gpu.py: np 1 over NCCL, np 2 staged as users run it, np 2 and 4 over NCCL
# with the test-only shared-GPU switch, within MATRIX_SECONDS=300; MATRIX=all for np 1-4 both
# ways). The benchmarks' tables and targets, met or missed, are printed at the end. Logs and
# results go to $OUT (default ./gpu-checks-out). Exit status: the number of failed steps.
#
# With the device tool of this workplace: here `tools/gpu_checks.sh --download-wheels`, then
# run `tools/gpu_checks.sh` there with carry ["gpu-wheels"] and timeout_s 600.
set -uo pipefail
cd "$(dirname "$0")/.."

PYVER=${PYVER:-3.12}
# A manylinux_2_28 machine runs wheels tagged for it or any older manylinux; some pip versions
# match --platform exactly, so each tag is named (mpi4py, for one, ships manylinux_2_5 wheels).
PLATFORMS=${PLATFORMS:-"manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64
manylinux2014_x86_64 manylinux_2_12_x86_64 manylinux2010_x86_64 manylinux_2_5_x86_64
manylinux1_x86_64"}
# What horolite adds to a python that has CuPy, NCCL, NumPy, pytest and setuptools.
WHEELS_FOR_HOROLITE=${WHEELS_FOR_HOROLITE:-"mpich mpi4py cffi pycparser"}

if [ "${1:-}" = "--download-wheels" ]; then
    dir=${2:-gpu-wheels}
    platforms=()
    for p in $PLATFORMS; do platforms+=(--platform "$p"); done
    python3 -m pip download --no-deps --only-binary=:all: --python-version "$PYVER" \
        --implementation cp "${platforms[@]}" -d "$dir" $WHEELS_FOR_HOROLITE || exit 1
    du -sh "$dir"
    exit 0
fi

WHEELS=$(realpath -m "${1:-gpu-wheels}")
OUT=$(realpath -m "${OUT:-gpu-checks-out}")
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
failed=0
step() {  # step NAME SECONDS COMMAND...: run it, log to $OUT/NAME.log, say how it went
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS run=(timeout "$limit")
    declare -F "$1" >/dev/null && run=()  # a function of this script: no time limit
    echo "== $name: $*"
    if "${run[@]}" "$@" >"$OUT/$name.log" 2>&1; then
        echo "   ok in $((SECONDS - t0)) s ($name.log)"
    else
        local rc=$?
        echo "   FAILED (exit $rc$([ $rc = 124 ] && echo ", over its $limit s")) in $((SECONDS - t0)) s:"
        tail -n 25 "$OUT/$name.log" | sed 's/^/   | /'
        failed=$((failed + 1))
    fi
}

if ! nvidia-smi -L >"$OUT/nvidia-smi.log" 2>&1; then
    echo "no GPU here (nvidia-smi -L failed; see $OUT/nvidia-smi.log)"; exit 100
fi
cat "$OUT/nvidia-smi.log"
ls "$WHEELS"/*.whl >/dev/null 2>&1 || {
    echo "no wheels in $WHEELS (make them where pip reaches PyPI: tools/gpu_checks.sh --download-wheels)"
    exit 101; }

PY=python3
VENV_GPU=0
if [ "${VENV:-auto}" = 1 ] || { [ "${VENV:-auto}" = auto ] &&
        python3 -c 'import sys; sys.exit(sys.prefix != sys.base_prefix)'; }; then
    VENV_GPU=1  # python3 is the system's: a virtual environment that sees its packages
    PY=$PWD/.venv-gpu/bin/python
fi
install_here() {
    if [ "$VENV_GPU" = 1 ]; then
        [ -x "$PY" ] || python3 -m venv --system-site-packages .venv-gpu || return 1
    else
        # python3 is a virtual environment already (the device machines' is): install there,
        # beside the CuPy and NCCL it loads (CuPy finds its CUDA wheels from its own prefix)
        echo "installing into python3's environment, $(python3 -c 'import sys; print(sys.prefix)')"
    fi
    "$PY" -m pip install -q --no-index --no-deps --force-reinstall "$WHEELS"/*.whl || return 1
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . || return 1
    "$PY" -c "import cupy, mpi4py, horolite._native; from cupy.cuda import nccl
print('CuPy', cupy.__version__, 'sees', cupy.cuda.runtime.getDeviceCount(), 'GPU(s); NCCL',
      nccl.get_version(), '; mpi4py', mpi4py.__version__)"
}
step install 240 install_here
BIN=$(dirname "$("$PY" -c 'import sys; print(sys.executable)')")
export PATH="$BIN:$PATH"
step check-build 60 horolite-run --check-build
step unit 120 "$PY" -m pytest -q -rs -p no:cacheprovider tests/unit/core/test_device.py \
    tests/unit/core/test_device_kernels.py tests/unit/core/test_staging.py \
    tests/unit/core/test_cuda_info.py tests/unit/execution tests/unit/api \
    tests/unit/test_expected_skips.py
step bench-step 180 horolite-run -np 1 "$PY" bench/step_allreduce.py --device-only --no-tf \
    --models resnet50,bert_base --steps 24 --blocks 4 --no-plot --out "$OUT/step_gpu_np1.json"
step bench-np1-nccl 180 horolite-run -np 1 "$PY" bench/gpu_allreduce.py --budget-mib 1024 \
    --no-plot --out "$OUT/gpu_allreduce_np1.json"
step bench-np2-staged 180 horolite-run -np 2 "$PY" bench/gpu_allreduce.py --budget-mib 512 \
    --no-plot --out "$OUT/gpu_allreduce_np2.json"
step bench-python 120 "$PY" bench/gpu_batch_python.py
case "${MATRIX:-short}" in
    all) matrix=() ;;
    *) matrix=(-k "1-as-users-run or 2-as-users-run or 2-shared-gpu-nccl or 4-shared-gpu-nccl") ;;
esac
step gpu-matrix "${MATRIX_SECONDS:-300}" "$PY" -m pytest -v -rs -p no:cacheprovider tests/test_matrix_gpu.py "${matrix[@]}"
echo
for f in step_gpu_np1 gpu_allreduce_np1 gpu_allreduce_np2; do
    if [ -f "$OUT/$f.md" ]; then echo "== $f"; cat "$OUT/$f.md"; echo; fi
done
[ -f "$OUT/bench-python.log" ] && { echo "== background thread per member"; cat "$OUT/bench-python.log"; }
echo "== $failed step(s) failed; logs in $OUT"
exit "$failed"
