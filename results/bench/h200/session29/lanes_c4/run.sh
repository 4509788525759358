#!/usr/bin/env bash
# Session 29 call 4: a head-major store's prefill lanes in one paged launch (default) against the per-lane cascade
# (cascwrap.py on): KVzip and AdaKV real prefill at 32K (chunk 4096, batch 1) beside dense; GPU tests of the prefill
# cascade and the head-major store on CUDA.
OUT=$1; C=$2
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
D=results/bench/h200/session29/lanes_c4
timeout 200 python3 -m pytest -q -p no:cacheprovider packages/sparse-kernels/tests/test_prefix_attention.py \
  tests/test_cuda_head_major.py > $OUT/gpu_tests.txt 2>&1; tail -3 $OUT/gpu_tests.txt
K=(bench --no-progress --commit "$C" --prompt-len 32768 --output-len 16 --batch-size 1 --prefill real
   --max-num-batched-tokens 4096 --max-num-seqs 8 --out $OUT/prefill)
T=(--tokenizer packages/sparse-serve/src/sparse_serve/assets/tiny-retrieval)
timeout 60 python3 $D/cascwrap.py off "${K[@]}" --sparse-method dense > $OUT/logs/dense.txt 2>&1
timeout 70 python3 $D/cascwrap.py off "${K[@]}" --append "${T[@]}" --sparse-method kvzip > $OUT/logs/kvzip_off.txt 2>&1
timeout 70 python3 $D/cascwrap.py on "${K[@]}" --append "${T[@]}" --sparse-method kvzip > $OUT/logs/kvzip_on.txt 2>&1
timeout 60 python3 $D/cascwrap.py off "${K[@]}" --append --sparse-method adakv > $OUT/logs/adakv_off.txt 2>&1
timeout 60 python3 $D/cascwrap.py on "${K[@]}" --append --sparse-method adakv > $OUT/logs/adakv_on.txt 2>&1
grep -A8 "^## Prefill" $OUT/prefill/bench.md | cut -c1-220
for f in $OUT/logs/*.txt; do echo "== $f"; tail -2 $f | cut -c1-200; done
