#!/usr/bin/env bash
# Issue 17 on one H200: the query-aware methods against dense at dense's largest batch (5), side by side
# in one folder (Qwen3-8B shape, dummy bf16 weights, 128K prompt, memory for 2K output, synthetic prefill,
# block 16, chunk 2048, pipelined decode under CUDA graphs, 256 timed steps, 3 profiled: each run's
# bench.json holds its kernels per step (`gpu_kernels_top`), its host steps (`step_seconds`), what may
# have stalled them (`stalls`) and torch's CPU threads (`host_threads`)).
# Usage, from the repository root with the packages importable (`uv run` here, or
# PYTHONPATH=$(ls -d packages/*/src | tr '\n' ':') on the GPU box):
#   COMMIT=<sha> bash results/bench/run_h200_query_aware.sh OUT_DIR [METHODS]
# METHODS: any of "quest quest_fp8 quest_together omnikv omnikv_fp8 retroinfer retroinfer_int8 retroinfer_one"
# (default: quest omnikv retroinfer; quest_together: page bounds by the heads-together kernel at $TOGETHER, 8 pages
# x 4 warps by default; retroinfer_int8: its centroids as int8 codes; retroinfer_one: its picks in one launch); dense
# runs first. About 1 minute a method.
set -euo pipefail
OUT=${1:-results/bench/h200/query_aware}
METHODS=${2:-quest omnikv retroinfer}
COMMIT=${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
BENCH=(python3 -m sparse_serve.cli bench --no-progress --commit "$COMMIT" --prompt-len 131072 --output-len 2048
  --timed-steps 256 --max-num-seqs 64 --profile-steps 3 --batch-size 5 --out "$OUT")
BUDGET=(--sink-keep-tokens 64 --decode-keep-tokens 1472 --recent-keep-tokens 512)  # Quest- / OmniKV-2048

"${BENCH[@]}"
for m in $METHODS; do
  case $m in
    quest) "${BENCH[@]}" --append --sparse-method quest "${BUDGET[@]}" ;;
    quest_fp8) "${BENCH[@]}" --append --sparse-method quest "${BUDGET[@]}" --kv-cache-dtype fp8 ;;
    quest_together) SPARSE_KERNELS_PAGE_BOUNDS_TOGETHER=${TOGETHER:-8:4} "${BENCH[@]}" --append --sparse-method quest "${BUDGET[@]}" ;;
    omnikv) "${BENCH[@]}" --append --sparse-method omnikv "${BUDGET[@]}" ;;
    omnikv_fp8) "${BENCH[@]}" --append --sparse-method omnikv "${BUDGET[@]}" --kv-cache-dtype fp8 ;;
    retroinfer) "${BENCH[@]}" --append --sparse-method retroinfer --max-num-seqs 8 ;;  # its defaults
    retroinfer_model) "${BENCH[@]}" --append --sparse-method retroinfer --max-num-seqs 8 --retroinfer-centroid-dtype model ;;
    retroinfer_two) SPARSE_KERNELS_PICKS_ONE_LAUNCH=0 "${BENCH[@]}" --append --sparse-method retroinfer --max-num-seqs 8 ;;
    *) echo "unknown method $m" >&2; exit 2 ;;
  esac
done
grep -E "^\| " "$OUT/bench.md" | head -12
python3 "$(dirname "$0")/engine_summary.py" "$OUT/bench.json"  # per run: median gap, busy, long steps, top kernels
