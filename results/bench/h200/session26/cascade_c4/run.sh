#!/usr/bin/env bash
# Session 26 call 4: the cascade prefill with cuDNN over unfolded GQA views (no q / out copies), one merge launch,
# prefix step 2048, cuDNN plans built at engine start: HF transformers and the engine side by side at 128K (twice:
# the first prefill of the process, then a second), 32K and 8K, batch 1, chunk 2048; then GPU tests.
OUT=$1; C=$2
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
timeout 360 python3 -m sparse_serve.cli bench --no-progress --commit "$C" --out $OUT/pf --prefill real \
  --prompt-len 131072,131072,32768,8192 --batch-size 1 --output-len 4 --warmup-steps 1 --max-num-seqs 8 --hf-baseline --hf-steps 2 \
  > $OUT/pf.txt 2>&1
timeout 120 python3 -m sparse_serve.cli bench --no-progress --commit "$C" --out $OUT/pf --append --prefill real --prompt-len 131072 \
  --batch-size 1 --output-len 4 --warmup-steps 1 --max-num-seqs 8 --max-num-batched-tokens 4096 > $OUT/pf4096.txt 2>&1
grep -A12 "^## Prefill" $OUT/pf/bench.md; tail -2 $OUT/pf.txt
(cd $OUT && tar czf pf.tgz pf pf.txt pf4096.txt && rm -rf pf pf.txt pf4096.txt)
timeout 150 python3 -m pytest -q -x -m "gpu or not gpu" -p no:cacheprovider packages/sparse-kernels/tests/test_prefix_attention.py \
  packages/sparse-kernels/tests/test_cluster_estimation.py tests/test_cuda_engine.py 2>&1 | tail -3 | tee $OUT/tests.txt
