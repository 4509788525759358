#!/usr/bin/env bash
# Session 26 call 6: the cascade merge in programs of 16 rows (81 us a call in one-row programs, call 5), 128K dense
# prefill side by side with HF transformers in one process, batch 1, chunk 2048; then the merge's tests on the GPU.
OUT=$1; C=$2
mkdir -p $OUT
timeout 240 python3 -m sparse_serve.cli bench --no-progress --commit "$C" --out $OUT/pf --prefill real \
  --prompt-len 131072 --batch-size 1 --output-len 4 --warmup-steps 1 --max-num-seqs 8 --hf-baseline --hf-steps 2 > $OUT/pf.txt 2>&1
grep -A5 "^## Prefill" $OUT/pf/bench.md; tail -1 $OUT/pf.txt
(cd $OUT && tar czf pf.tgz pf pf.txt && rm -rf pf pf.txt)
timeout 60 python3 -m pytest -q -x -m "gpu or not gpu" -p no:cacheprovider packages/sparse-kernels/tests/test_cluster_estimation.py \
  packages/sparse-kernels/tests/test_prefix_attention.py 2>&1 | tail -2 | tee $OUT/tests.txt
