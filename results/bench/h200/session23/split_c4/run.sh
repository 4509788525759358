#!/usr/bin/env bash
# Session 23 call 4: the decode split target at batch 5 (programs per SM when the lists do not cover every SM),
# whole Qwen3-8B decode step from the kernels: 2K, 8K, 10K and 128K tokens a request.
OUT=$1
mkdir -p $OUT
export PYTHONPATH=$PYTHONPATH:$PWD/packages/sparse-kernels/benchmarks
timeout 200 python3 packages/sparse-kernels/benchmarks/decode_step_probe.py --batch 5 --kv-len 2048,8192,10240,131072 \
  --per-sm 4,2,3,6 --no-pdl-off --json $OUT/split.json > $OUT/split.txt 2>&1; cat $OUT/split.txt
