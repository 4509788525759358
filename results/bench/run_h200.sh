#!/usr/bin/env bash
# The decode benchmark of results/bench, as run on one H200 (Qwen3-8B shape, dummy bf16 weights,
# synthetic prefill). Usage, from the repository root with the packages importable
# (`uv run` here, or PYTHONPATH=$(ls -d packages/*/src | tr '\n' ':') on the GPU box):
#   COMMIT=<sha> bash results/bench/run_h200.sh OUT_DIR
set -euo pipefail
OUT=${1:-results/bench/h200}
COMMIT=${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
BENCH=(python3 -m sparse_serve.cli bench --no-progress --commit "$COMMIT")

# 1. Dense at 32K and 128K, batch 1 and the largest batch that fits, 256 output tokens (200 steps
#    timed after 3 warm-up steps, 5 more profiled), and HF transformers at batch 1 on the same shape.
"${BENCH[@]}" --out "$OUT/dense" --prompt-len 32768,131072 --batch-size 1,max --output-len 256 \
  --timed-steps 200 --profile-steps 5 --hf-baseline --hf-steps 20

# 2. Issue 4's reference: dense at 128K with memory planned for 2048 output tokens, its largest
#    batch (256 steps timed: dense KV grows only 1.6% over 2048 steps).
"${BENCH[@]}" --out "$OUT/snapkv" --prompt-len 131072 --batch-size max --output-len 2048 \
  --timed-steps 256 --profile-steps 5
DENSE_MAX=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['invocations'][-1]['runs'][0]['batch_size'])" \
  "$OUT/snapkv/bench.json")

# 3. SnapKV, budget 8192 = 64 sink + 7616 + 512 recent, at dense's largest batch and its own,
#    128K prompt, every one of the 2048 decode steps (3 warm-up, 2040 timed, 5 profiled).
"${BENCH[@]}" --out "$OUT/snapkv" --append --sparse-method snapkv --sink-keep-tokens 64 \
  --decode-keep-tokens 7616 --recent-keep-tokens 512 --prompt-len 131072 --batch-size "$DENSE_MAX,max" \
  --output-len 2048 --timed-steps 2040 --profile-steps 5

# 4. Issue 5: Quest, budget 2048 = 64 sink + 1472 + 512 recent, at dense's largest batch, 128K prompt,
#    next to dense in the same invocation folder (pages picked on the device per layer; block summaries).
"${BENCH[@]}" --out "$OUT/quest" --prompt-len 131072 --batch-size max --output-len 2048 \
  --timed-steps 64 --max-num-seqs 8
"${BENCH[@]}" --out "$OUT/quest" --append --sparse-method quest --sink-keep-tokens 64 \
  --decode-keep-tokens 1472 --recent-keep-tokens 512 --prompt-len 131072 --batch-size max \
  --output-len 2048 --timed-steps 64 --max-num-seqs 8

# 5. Issue 5, GPU paths: Quest (page bounds read through the block tables, one ascending top-k kernel,
#    summaries folded in the step) and OmniKV (filter layers: logits through the tables, attention from
#    them reading V only, token scores and the set picked on the device) in CUDA graphs (every batch
#    size up to 8 captured), budget 2048 = 64 sink + 1472 + 512 recent, at dense's largest batch,
#    128K prompt (memory planned for 2048 output tokens), next to dense; 48 steps timed, 3 profiled.
#    benchmarks/qa_device_run.sh runs this part alone (with the CUDA tests) as it was measured.
"${BENCH[@]}" --out "$OUT/query_aware" --prompt-len 131072 --batch-size max --output-len 2048 \
  --timed-steps 48 --profile-steps 3 --max-num-seqs 8
QA_MAX=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['invocations'][0]['runs'][0]['batch_size'])" \
  "$OUT/query_aware/bench.json")
for METHOD in quest omnikv; do
  "${BENCH[@]}" --out "$OUT/query_aware" --append --sparse-method "$METHOD" --sink-keep-tokens 64 \
    --decode-keep-tokens 1472 --recent-keep-tokens 512 --prompt-len 131072 --batch-size "$QA_MAX" \
    --output-len 2048 --timed-steps 48 --profile-steps 3 --max-num-seqs 8
done

# 6. Issue 3's final measurement, pipelined decode (async scheduling): dense at 32K and 128K, batch 1
#    and the largest batch, 256 output tokens, 200 steps timed end to end (3 warm-up, 3 more profiled),
#    async on, then the same with async off; max-num-seqs 32 keeps graph capture short (both largest
#    batches, 23 and 5, fit). results/bench/h200/dense_async/run_device.sh ran this part as measured
#    (after the CUDA tests, nothing else on the GPU, with a GPU clock log).
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv -lms 500 \
  > "$OUT/dense_async_clocks.csv" 2>&1 &
SMI=$!
for ASYNC in --async-scheduling --no-async-scheduling; do
  "${BENCH[@]}" --out "$OUT/dense_async/dense" $([ "$ASYNC" = --no-async-scheduling ] && echo --append) \
    --prompt-len 32768,131072 --batch-size 1,max --output-len 256 --timed-steps 200 --profile-steps 3 \
    --max-num-seqs 32 "$ASYNC"
done
kill "$SMI"

# 7. Issue 3, session 4: small-M linear kernels (decode's projections and LM head in one Triton launch
#    each) and programmatic dependent launch between the decode-path kernels. Dense at 32K and 128K,
#    batch 1 and the largest batch, 256 output tokens, 200 steps timed end to end; HF transformers at
#    batch 1 first in the same process; then PDL off and async off for side-by-side ratios.
#    results/bench/h200/dense_pdl/run_device.sh ran this part as measured (after the CUDA tests).
"${BENCH[@]}" --out "$OUT/dense_pdl/dense" --prompt-len 32768,131072 --batch-size 1,max --output-len 256 \
  --timed-steps 200 --profile-steps 3 --max-num-seqs 32 --async-scheduling --hf-baseline --hf-steps 20
