#!/usr/bin/env bash
# Issue 5 on one H200, in one call: the CUDA tests of the query-aware GPU paths, then dense, Quest and
# OmniKV decode at 128K x dense's largest batch (part 5 of results/bench/run_h200.sh, profiled), then
# the CUDA engine tests with whatever time is left. Run from the repository root with the packages
# importable (PYTHONPATH=$(ls -d packages/*/src | tr '\n' ':')tests). Usage:
#   COMMIT=<sha> BUDGET_S=205 bash benchmarks/qa_device_run.sh OUT_DIR
set -uo pipefail
OUT=${1:?output folder}
COMMIT=${COMMIT:-unknown}
BUDGET_S=${BUDGET_S:-205}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
say() { echo "[$(date -u +%H:%M:%S) +${SECONDS}s] $*" | tee -a "$LOG"; }
cap() { local left=$((BUDGET_S - SECONDS - 5)); echo $((left < $1 ? left : $1)); }  # a step's timeout

nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv -lms 500 \
  >"$OUT/clocks.csv" 2>&1 &
SMI=$!
say "kernel tests (CUDA, Triton compiled)"
timeout "$(cap 60)" python3 -m pytest -q -p no:cacheprovider \
  packages/sparse-kernels/tests/test_page_bounds.py packages/sparse-kernels/tests/test_paged_logits.py \
  packages/sparse-kernels/tests/test_summary_update.py packages/sparse-kernels/tests/test_top_k_ascending.py \
  packages/sparse-kernels/tests/test_selection_entries.py packages/sparse-kernels/tests/test_logits_attention.py \
  >"$OUT/tests_kernels.txt" 2>&1
say "kernel tests rc=$? ($(tail -1 "$OUT/tests_kernels.txt"))"

BENCH=(python3 -m sparse_serve.cli bench --no-progress --commit "$COMMIT")
say "dense"
timeout "$(cap 70)" "${BENCH[@]}" --out "$OUT/query_aware" --prompt-len 131072 --batch-size max --output-len 2048 \
  --timed-steps 48 --profile-steps 3 --max-num-seqs 8 >>"$LOG" 2>&1
say "dense rc=$?"
DENSE_MAX=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['invocations'][0]['runs'][0]['batch_size'])" \
  "$OUT/query_aware/bench.json" 2>/dev/null || echo 5)
for METHOD in quest omnikv; do
  say "$METHOD at batch $DENSE_MAX"
  timeout "$(cap 60)" "${BENCH[@]}" --out "$OUT/query_aware" --append --sparse-method "$METHOD" --sink-keep-tokens 64 \
    --decode-keep-tokens 1472 --recent-keep-tokens 512 --prompt-len 131072 --batch-size "$DENSE_MAX" \
    --output-len 2048 --timed-steps 48 --profile-steps 3 --max-num-seqs 8 >>"$LOG" 2>&1
  say "$METHOD rc=$?"
done

LEFT=$((BUDGET_S - SECONDS))
say "engine tests (CUDA) with ${LEFT}s left"
if [ "$LEFT" -gt 15 ]; then
  timeout "$LEFT" python3 -m pytest -q -p no:cacheprovider tests/test_cuda_engine.py \
    tests/test_async_scheduling.py::test_cuda_query_aware_pipelined_equal_cpu \
    -k "query_aware or selecting or staggered or graphs_equal" >"$OUT/tests_cuda_engine.txt" 2>&1
  say "engine tests rc=$? ($(tail -1 "$OUT/tests_cuda_engine.txt"))"
fi
kill "$SMI" 2>/dev/null
say "done"
