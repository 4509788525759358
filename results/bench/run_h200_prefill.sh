#!/usr/bin/env bash
# Issue 16 item 1: prefill measured on one H200 (Qwen3-8B shape, dummy bf16 weights, real prefill).
# Usage, from the repository root with the packages importable (`uv run` here, or
# PYTHONPATH=$(ls -d packages/*/src | tr '\n' ':') on the GPU box):
#   COMMIT=<sha> bash results/bench/run_h200_prefill.sh OUT_DIR [PARTS]
# PARTS: which of "prefill snapkv_max e2e" to run (all by default). Each part is meant to fit in one
# 10-minute device call (estimates: prefill ~5 min, snapkv_max ~5 min, e2e ~6 min).
set -euo pipefail
OUT=${1:-results/bench/h200/prefill}
PARTS=${2:-prefill snapkv_max e2e}
COMMIT=${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
BENCH=(python3 -m sparse_serve.cli bench --no-progress --commit "$COMMIT")

# 1. Dense prefill at 128K, 32K and 8K, batch 1 and 4 concurrent prompts (chunk 2048), HF transformers
#    prefill (and decode) at batch 1 first in the same process, one profiled chunk per length. The
#    decode after each prefill is short (16 tokens: the prefill is what is measured here).
if [[ " $PARTS " == *" prefill "* ]]; then
  "${BENCH[@]}" --out "$OUT/dense" --prefill real --prompt-len 131072,32768,8192 --batch-size 1,4 \
    --output-len 16 --warmup-steps 3 --max-num-seqs 8 --hf-baseline --hf-steps 8 --profile-prefill
fi

# 2. The large-batch real-prefill case of issue 16: SnapKV (default budget 8192) at its largest batch,
#    32K prompts; decodes wait until the whole batch is prefilled, so every timed step runs all of it
#    (the table's "resident min-max" column shows the batch that really ran).
if [[ " $PARTS " == *" snapkv_max "* ]]; then
  "${BENCH[@]}" --out "$OUT/snapkv_max" --prefill real --sparse-method snapkv --prompt-len 32768 --batch-size max
fi

# 3. End to end: 4 requests of 128K in / 2K out arriving at once, wall time to the last token
#    (prefill included), dense then SnapKV (default budget 8192) into the same folder.
if [[ " $PARTS " == *" e2e "* ]]; then
  "${BENCH[@]}" --out "$OUT/e2e" --e2e 4 --prompt-len 131072 --output-len 2048 --max-num-seqs 8
  "${BENCH[@]}" --out "$OUT/e2e" --append --e2e 4 --prompt-len 131072 --output-len 2048 --max-num-seqs 8 \
    --sparse-method snapkv
fi
