#!/usr/bin/env bash
# GPU-side check in one call, inside a time budget (GPU_CHECK_BUDGET seconds, default 480):
#   1. build osd_kernels._C with the CUDA kernels against the machine's CUDA torch;
#   2. the GPU-specific tests (engine-level chi-square on cuda eager and graphed, graphed vs
#      eager drafting, EAGLE on cuda, the online learner on cuda with its captured training
#      step, long prompts; op tests on cuda against the references);
#   3. compile every Triton kernel for the machine's Triton (scripts/triton_check.py);
#   4. the speed goals at their own sizes (scripts/gpu_goals.py: samplers at V = 128,256,
#      attention over 4k-32k prefixes, 1.1B decode against the HBM roofline, speculative
#      vs plain at batch 1, 8, 64);
#   5. graphed top-k / top-p steps against eager ones at batch 1, 4, 64 and 4,096, with
#      CUDA_LAUNCH_BLOCKING=1, so a failure names its op;
#   6. the GPU microbenchmarks (triton and cuda providers, auto_k with a useless draft),
#      then the flashinfer provider beside them (bench/flashinfer_providers.py; skipped
#      where flashinfer-python is not installed) with its own cap and JSON, since its
#      kernels JIT-compile on first use; its rc is reported but does not fail the check;
#   7. the rest of the suite with the GPU present, in whatever time is left;
#   8. a summary table of the stages.
# Each stage gets at most its own cap and never more than the time left, so the whole call
# ends inside the budget; a test stage cut short is interrupted (SIGINT), so pytest still
# prints its failures, and reports rc 124 or 130. Tests run verbosely on parallel workers
# when pytest-xdist is installed (a crashing test then takes down one worker, not the
# stage; a device-side assert fails the rest of its worker's tests too, so read the first
# failure of each worker). It uses the machine's own python (PYTHON, default python3) and
# installs nothing, since a GPU box may have no network. Results land in ${OUT:-out}/
# (8 files; JSON under /tmp/osd_gpu_check).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUTDIR=${OUT:-out}
BUDGET=${GPU_CHECK_BUDGET:-480}
JSON=/tmp/osd_gpu_check
mkdir -p "$OUTDIR" "$JSON"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
START=$(date +%s)

# cap SECONDS -> the seconds a stage may run: its cap, or what is left of the budget
cap() { local left=$(( BUDGET - ($(date +%s) - START) )); (( left < $1 )) && echo $(( left > 5 ? left : 5 )) || echo "$1"; }
summary() { grep -Eo "[0-9]+ (passed|failed|skipped|error)[^=]*" "$1" 2>/dev/null | tail -n 1; }
WORKERS=()
$PY -c "import xdist" 2>/dev/null && WORKERS=(-n "${GPU_CHECK_WORKERS:-12}")
PER_TEST=()
$PY -c "import pytest_timeout" 2>/dev/null && PER_TEST=(--timeout 150)
# test workers share the cores: two threads each
PYTEST=(env OMP_NUM_THREADS=${GPU_CHECK_THREADS:-2} $PY -m pytest -v --tb=short -p no:cacheprovider
        --benchmark-disable -rfE "${WORKERS[@]}" "${PER_TEST[@]}")
GPU_TESTS="cuda or graphed_drafting"

echo "== environment"
$PY - <<'PY'
import torch, triton
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__,
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
PY
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv || true

echo "== build (CUDA)"
t0=$(date +%s)
MAX_JOBS=${MAX_JOBS:-16} timeout "$(cap 150)" $PY setup.py -q build_ext --inplace 2>&1 | tail -n 20
build_rc=${PIPESTATUS[0]}
echo "build: $(( $(date +%s) - t0 )) s"
$PY -c "from osd_kernels import _C; assert _C.WITH_CUDA, 'extension built without CUDA'; print('osd_kernels._C WITH_CUDA =', _C.WITH_CUDA)" || build_rc=1

echo "== GPU tests"
timeout -s INT "$(cap 180)" "${PYTEST[@]}" -k "$GPU_TESTS" tests 2>&1 | tee "$OUTDIR/gpu_tests_first.log" \
    | grep -E "^(FAILED|ERROR)|passed|failed" | tail -n 40
first_rc=${PIPESTATUS[0]}

echo "== Triton compile check (this machine's Triton)"
timeout "$(cap 60)" $PY scripts/triton_check.py 2>&1 | tee "$OUTDIR/triton_check.log" | tail -n 15
triton_rc=${PIPESTATUS[0]}

echo "== speed goals (samplers, attention, decode roofline, speculation at batch)"
timeout "$(cap 110)" $PY scripts/gpu_goals.py --json "$JSON/gpu_goals.json" 2>&1 | tee "$OUTDIR/gpu_goals.md" | tail -n 45
goals_rc=${PIPESTATUS[0]}

echo "== graphed top-k / top-p steps, launches blocking"
CUDA_LAUNCH_BLOCKING=1 timeout -s INT "$(cap 60)" "${PYTEST[@]}" \
    -k "(truncated and cuda) or (sampled_joint and graphs1) or cuda_graph_of_a" \
    tests/test_graphs.py tests/test_speculative.py 2>&1 | tee "$OUTDIR/gpu_probe.log" \
    | grep -E "^(FAILED|ERROR)|passed|failed" | tail -n 30
probe_rc=${PIPESTATUS[0]}

echo "== GPU benchmarks"
timeout "$(cap 75)" $PY -m pytest -q -p no:cacheprovider bench -k "cuda or triton or auto_k" \
    --benchmark-json="$JSON/gpu_bench.json" 2>&1 | tail -n 30
bench_rc=${PIPESTATUS[0]}
$PY scripts/bench_table.py "$JSON/gpu_bench.json" > "$OUTDIR/gpu_bench.md" 2>&1 || true
echo "== FlashInfer beside them (skipped without flashinfer-python)"
timeout "$(cap 90)" $PY -m pytest -q -rs -p no:cacheprovider bench -k flashinfer \
    --benchmark-json="$JSON/flashinfer_bench.json" 2>&1 | tail -n 15
fi_rc=${PIPESTATUS[0]}
$PY scripts/bench_table.py "$JSON/flashinfer_bench.json" > "$OUTDIR/flashinfer_bench.md" 2>&1 || true

echo "== the rest of the suite (with a GPU present), in the time left"
timeout -s INT "$(cap 300)" "${PYTEST[@]}" -k "not ($GPU_TESTS)" tests 2>&1 \
    | tee "$OUTDIR/gpu_tests_rest.log" | grep -E "^(FAILED|ERROR)|passed|failed" | tail -n 25
rest_rc=${PIPESTATUS[0]}

echo "== results ($(( $(date +%s) - START )) s of a ${BUDGET} s budget)"
{
  echo "| stage | rc | result |"
  echo "|---|---|---|"
  echo "| CUDA build | $build_rc | |"
  echo "| GPU tests | $first_rc | $(summary "$OUTDIR/gpu_tests_first.log") |"
  echo "| triton compile check | $triton_rc | $OUTDIR/triton_check.log |"
  echo "| speed goals table | $goals_rc | $OUTDIR/gpu_goals.md |"
  echo "| graphed top-k / top-p vs eager | $probe_rc | $(summary "$OUTDIR/gpu_probe.log") |"
  echo "| GPU benchmarks | $bench_rc | $OUTDIR/gpu_bench.md |"
  echo "| FlashInfer benchmarks (not in the exit status) | $fi_rc | $OUTDIR/flashinfer_bench.md |"
  echo "| rest of the suite | $rest_rc | $(summary "$OUTDIR/gpu_tests_rest.log") |"
} | tee "$OUTDIR/gpu_summary.md"
exit $(( build_rc != 0 || first_rc != 0 || triton_rc != 0 || goals_rc != 0 || probe_rc != 0 || bench_rc != 0 || rest_rc != 0 ))
