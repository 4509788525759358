#!/usr/bin/env bash
# Issue 18 (and issue 19's TP=1 side): the published system's headline model shapes on one H200,
# dummy bf16 weights, 128K in / 2K out planned, synthetic prefill, block 16, CUDA graphs where the
# engine captures them. Usage, from the repository root with the packages importable:
#   COMMIT=<sha> bash results/bench/run_h200_models.sh OUT_DIR [MODELS] [TP]
# MODELS: any of "qwen3-30b-a3b glm-4.7-flash" (both by default; each fits one 10-minute call).
# TP: tensor-parallel size (default 1; 2 needs two GPUs and is issue 19's run).
set -euo pipefail
OUT=${1:-results/bench/h200/models}
MODELS=${2:-qwen3-30b-a3b glm-4.7-flash}
TP=${3:-1}
COMMIT=${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
CONFIGS=packages/sparse-serve/src/sparse_serve/bench/configs
STEPS=(--output-len 2048 --timed-steps 48 --profile-steps 3 --prompt-len 131072)
for MODEL in $MODELS; do
  BENCH=(python3 -m sparse_serve.cli bench --no-progress --commit "$COMMIT" --model "$CONFIGS/$MODEL"
         --tensor-parallel-size "$TP")
  DIR="$OUT/$MODEL-tp$TP"
  # 1. Dense at batch 1 and its largest batch.
  "${BENCH[@]}" --out "$DIR" "${STEPS[@]}" --batch-size 1,max
  DENSE_MAX=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['invocations'][-1]['runs'][-1]['batch_size'])" \
    "$DIR/bench.json")
  # 2. SnapKV, budget 8192 = 64 sink + 7616 + 512 recent, at dense's largest batch and its own.
  "${BENCH[@]}" --out "$DIR" --append "${STEPS[@]}" --sparse-method snapkv --sink-keep-tokens 64 \
    --decode-keep-tokens 7616 --recent-keep-tokens 512 --batch-size "$DENSE_MAX,max"
  # 3. Quest, budget 2048 = 64 sink + 1472 + 512 recent, at dense's largest batch (its block summaries
  #    take room: where that batch does not fit, the report says so) and at its own largest.
  "${BENCH[@]}" --out "$DIR" --append "${STEPS[@]}" --sparse-method quest --sink-keep-tokens 64 \
    --decode-keep-tokens 1472 --recent-keep-tokens 512 --batch-size "$DENSE_MAX,max"
done
