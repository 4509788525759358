#!/usr/bin/env bash
# Issue 14's decode benchmark: quantized KV stores next to dense on one H200 (Qwen3-8B shape, dummy
# bf16 weights, synthetic prefill, 128K prompt, memory planned for 2048 output tokens), all in one
# output folder so the report puts them side by side. Usage, from the repository root with the
# packages importable (`uv run` here, or PYTHONPATH=$(ls -d packages/*/src | tr '\n' ':') on the GPU box):
#   COMMIT=<sha> bash results/bench/run_h200_kv_dtypes.sh OUT_DIR [TIMED_STEPS] [PARTS]
# PARTS: which of "dense stores snapkv" to run (all by default; a later part reads dense's largest batch
# from OUT_DIR/bench.json, so run "dense" first).
set -euo pipefail
OUT=${1:-results/bench/h200/kv_dtypes}
STEPS=${2:-64}
PARTS=${3:-dense stores snapkv}
STORES=${STORES:-"fp8_kv kivi:4 kivi:2 turboquant:4 turboquant:3"}
COMMIT=${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
BENCH=(python3 -m sparse_serve.cli bench --no-progress --commit "$COMMIT" --prompt-len 131072 --output-len 2048)

# 1. Dense at its largest batch (the reference every ratio is taken against).
if [[ " $PARTS " == *" dense "* ]]; then
  "${BENCH[@]}" --out "$OUT" --batch-size max --timed-steps "$STEPS" --max-num-seqs 64
fi
DENSE_MAX=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['invocations'][0]['runs'][0]['batch_size'])" \
  "$OUT/bench.json")

# 2. Each quantized store at dense's largest batch and at its own (dense reads over the store).
if [[ " $PARTS " == *" stores "* ]]; then
  for STORE in $STORES; do  # method[:bits]
    METHOD=${STORE%%:*}
    BITS=()
    [[ $STORE == *:* ]] && BITS=("--${METHOD}-bits" "${STORE#*:}")
    "${BENCH[@]}" --out "$OUT" --append --sparse-method "$METHOD" "${BITS[@]}" --batch-size "$DENSE_MAX,max" \
      --timed-steps "$STEPS" --max-num-seqs 64
  done
fi

# 3. SnapKV, budget 8192 = 64 sink + 7616 + 512 recent, over bf16 and over fp8, each at its largest batch.
if [[ " $PARTS " == *" snapkv "* ]]; then
  SNAP=(--sparse-method snapkv --sink-keep-tokens 64 --decode-keep-tokens 7616 --recent-keep-tokens 512)
  "${BENCH[@]}" --out "$OUT" --append "${SNAP[@]}" --batch-size max --timed-steps "$STEPS" --max-num-seqs 192
  "${BENCH[@]}" --out "$OUT" --append "${SNAP[@]}" --kv-cache-dtype fp8 --batch-size max --timed-steps "$STEPS" \
    --max-num-seqs 192
fi
