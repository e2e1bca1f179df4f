#!/usr/bin/env bash
# GPU-side check in one call (target: under 8 minutes on one H100/H200):
#   1. build osd_kernels._C with the CUDA kernels against the machine's CUDA torch;
#   2. run the whole test suite on cuda (GPU tests are enabled by torch.cuda.is_available());
#   3. run the GPU benchmarks (triton and cuda providers);
#   4. print a markdown table of the benchmark results.
# It uses the machine's own python (PYTHON, default python3) and installs nothing, since a
# GPU box may have no network. Results land in ${OUT:-out}/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUTDIR=${OUT:-out}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET

echo "== environment"
$PY - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device",
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
PY
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv || true

echo "== build (CUDA)"
t0=$(date +%s)
MAX_JOBS=${MAX_JOBS:-16} $PY setup.py -q build_ext --inplace 2>&1 | tail -n 20
echo "build: $(( $(date +%s) - t0 )) s"
$PY -c "from osd_kernels import _C; assert _C.WITH_CUDA, 'extension built without CUDA'; print('osd_kernels._C WITH_CUDA =', _C.WITH_CUDA)"

echo "== tests on cuda"
set +e
timeout 300 $PY -m pytest -q -p no:cacheprovider --benchmark-disable -x tests 2>&1 | tee "$OUTDIR/gpu_tests.log" | tail -n 40
test_rc=${PIPESTATUS[0]}
echo "== GPU benchmarks"
timeout 180 $PY -m pytest -q -p no:cacheprovider bench -k "cuda or triton" \
    --benchmark-json="$OUTDIR/gpu_bench.json" 2>&1 | tail -n 60
bench_rc=${PIPESTATUS[0]}
set -e

echo "== results"
$PY scripts/bench_table.py "$OUTDIR/gpu_bench.json" | tee "$OUTDIR/gpu_bench.md"
echo "tests rc=$test_rc bench rc=$bench_rc"
exit $(( test_rc != 0 || bench_rc != 0 ))
