#!/usr/bin/env bash
# GPU-side check in one call (target: under 8 minutes on one H100/H200):
#   1. build osd_kernels._C with the CUDA kernels against the machine's CUDA torch;
#   2. run the suite with the GPU present: first the GPU-specific tests (engine-level
#      chi-square on cuda eager and graphed, graphed vs eager drafting, the online learner
#      on cuda with its captured training step, long prompts), then everything else
#      (tests enabled by torch.cuda.is_available());
#   3. compile every Triton kernel for the machine's Triton (scripts/triton_check.py);
#   4. run the GPU benchmarks (triton and cuda providers);
#   5. measure the speed goals at their own sizes (scripts/gpu_goals.py: samplers at
#      V = 128,256, attention over 4k-32k prefixes, 1.1B decode against the HBM roofline,
#      speculative vs plain at batch 1, 8, 64);
#   6. print the benchmark table and a summary table of the stages.
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

echo "== GPU-first tests (engine distribution on cuda, graphs, online learner on cuda)"
set +e
timeout 240 $PY -m pytest -q -p no:cacheprovider --benchmark-disable -rfE \
    -k "cuda or graphs or sampled_joint or online_alpha or background_learners or long_prompt" \
    tests 2>&1 | tee "$OUTDIR/gpu_tests_first.log" | tail -n 40
first_rc=${PIPESTATUS[0]}
echo "== the rest of the suite (with a GPU present)"
timeout 200 $PY -m pytest -q -p no:cacheprovider --benchmark-disable -rfE \
    -k "not (cuda or graphs or sampled_joint or online_alpha or background_learners or long_prompt)" \
    tests 2>&1 | tee "$OUTDIR/gpu_tests_rest.log" | tail -n 25
rest_rc=${PIPESTATUS[0]}
echo "== Triton compile check (this machine's Triton)"
timeout 60 $PY scripts/triton_check.py 2>&1 | tail -n 15
triton_rc=${PIPESTATUS[0]}
echo "== GPU benchmarks"
timeout 150 $PY -m pytest -q -p no:cacheprovider bench -k "cuda or triton" \
    --benchmark-json="$OUTDIR/gpu_bench.json" 2>&1 | tail -n 60
bench_rc=${PIPESTATUS[0]}
echo "== speed goals (samplers, attention, decode roofline, speculation at batch)"
timeout 180 $PY scripts/gpu_goals.py --json "$OUTDIR/gpu_goals.json" 2>&1 | tee "$OUTDIR/gpu_goals.md" | tail -n 45
goals_rc=${PIPESTATUS[0]}
set -e

echo "== results"
$PY scripts/bench_table.py "$OUTDIR/gpu_bench.json" | tee "$OUTDIR/gpu_bench.md" || true
summary() { grep -Eo "[0-9]+ (passed|failed|skipped|error)[^=]*" "$1" | tail -n 1; }
{
  echo "| stage | rc | result |"
  echo "|---|---|---|"
  echo "| GPU-first tests | $first_rc | $(summary "$OUTDIR/gpu_tests_first.log") |"
  echo "| rest of the suite | $rest_rc | $(summary "$OUTDIR/gpu_tests_rest.log") |"
  echo "| triton compile check | $triton_rc | |"
  echo "| GPU benchmarks | $bench_rc | $OUTDIR/gpu_bench.md |"
  echo "| speed goals table | $goals_rc | $OUTDIR/gpu_goals.md |"
} | tee "$OUTDIR/gpu_summary.md"
exit $(( first_rc != 0 || rest_rc != 0 || triton_rc != 0 || bench_rc != 0 || goals_rc != 0 ))
