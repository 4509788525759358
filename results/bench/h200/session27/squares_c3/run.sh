#!/usr/bin/env bash
# Session 27 call 3 (issue 16): each prefill chunk's own causal square in cuDNN (CASCADE_SQUARES) instead of the
# paged Triton kernel. GPU tests of the split; then the 128K dense prefill, batch 1: chunk 2048 with squares, side
# by side with HF transformers in the same process; chunk 2048 without squares (sqwrap.py); chunks 4096 and 8192
# with squares.
OUT=$1; C=$2
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
timeout 90 python3 -m pytest -q -x -m "gpu or not gpu" -p no:cacheprovider packages/sparse-kernels/tests/test_cluster_estimation.py \
  packages/sparse-kernels/tests/test_prefix_attention.py 2>&1 | tail -3 | tee $OUT/tests.txt
A=(bench --no-progress --commit "$C" --out $OUT/pf --prefill real --batch-size 1 --output-len 4 --warmup-steps 1 --max-num-seqs 8)
timeout 200 python3 -m sparse_serve.cli "${A[@]}" --prompt-len 131072 --hf-baseline --hf-steps 2 > $OUT/logs/sq2048_hf.txt 2>&1
tail -2 $OUT/logs/sq2048_hf.txt
timeout 100 python3 sqwrap.py "${A[@]}" --commit "$C+nosquares" --append --prompt-len 131072 > $OUT/logs/nosq2048.txt 2>&1
tail -2 $OUT/logs/nosq2048.txt
for c in 8192 4096; do
  timeout 100 python3 -m sparse_serve.cli "${A[@]}" --append --prompt-len 131072 --max-num-batched-tokens $c > $OUT/logs/sq$c.txt 2>&1
  tail -1 $OUT/logs/sq$c.txt
done
grep -A12 "^## Prefill" $OUT/pf/bench.md
(cd $OUT && tar czf pf.tgz pf logs && rm -rf pf logs)
