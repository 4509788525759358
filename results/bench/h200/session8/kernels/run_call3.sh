#!/usr/bin/env bash
set -x
OUT=$1; COMMIT=$2
mkdir -p $OUT
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$COMMIT")
# KVzip's extra prefill cost at 32K (issue 15), real prefill, chunk 4096, next to dense
"${B[@]}" --out $OUT/kvzip --prefill real --prompt-len 32768 --output-len 16 --batch-size 1 --max-num-batched-tokens 4096 --max-num-seqs 4
"${B[@]}" --out $OUT/kvzip --append --prefill real --prompt-len 32768 --output-len 16 --batch-size 1 --max-num-batched-tokens 4096 --max-num-seqs 4 --sparse-method kvzip
# split target at dense's 128K batch 5
PYTHONPATH=$PYTHONPATH:packages/sparse-kernels/benchmarks timeout 60 python3 packages/sparse-kernels/benchmarks/decode_bandwidth.py --kv-len 131072 --cases 5x2,1x8 --per-sm 4 --json $OUT/split_sweep_128k.json > $OUT/split_sweep_128k.txt 2>&1
# quality of every method at 25% budget
timeout 230 python3 scripts/eval_kv_dtypes.py --set methods --device cuda --samples-per-cell 4 --out $OUT/methods_quality > $OUT/eval_log.txt 2>&1
echo "eval rc $?"
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_head_major.py tests/test_eviction_pipeline.py tests/test_batched_eviction.py -k "cuda" > $OUT/cuda_tests.txt 2>&1; tail -3 $OUT/cuda_tests.txt
