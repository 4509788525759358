#!/usr/bin/env bash
# Issue 20's serving run on one H200: Qwen3-8B shape with dummy weights, a long-context prompt mix
# (8K-64K tokens), Poisson arrivals at two rates, dense vs SnapKV vs Quest (each method's defaults),
# the engine in its own process (sparse-serve serve's default). Each method is bounded by
# PER_METHOD_S so that all three fit one device call; a run cut short keeps the rates it finished.
#   benchmarks/serving/run_h200_long.sh OUT_DIR [more bench_serving.py / serve arguments, e.g. --commit SHA]
# then, where matplotlib is:  python benchmarks/serving/report_methods.py OUT_DIR
set -uo pipefail
out=${1:-results/serving/h200-qwen3-8b-long}
shift || true
per_method_s=${PER_METHOD_S:-125}
common=(
  --num-requests 10 --request-rates 0.5,2 --prompt-lens 8192,16384,32768,65536 --output-lens 128,256
  --num-warmup 1 --startup-timeout-s 90
  --model packages/sparse-serve/src/sparse_serve/bench/configs/qwen3-8b --load-format dummy
  --tokenizer packages/sparse-serve/src/sparse_serve/assets/tiny-retrieval
  --max-model-len 66560 --max-num-seqs 32 --max-cuda-graph-batch-size 32
)
for method in dense snapkv quest; do
  echo "== $method $(date -u +%T)"
  timeout -s INT "$per_method_s" "${PYTHON:-python3}" benchmarks/serving/bench_serving.py "${common[@]}" \
    --sparse-method "$method" --out "$out/$method" "$@" || echo "$method ended with status $?"
done
echo "== done $(date -u +%T)"
