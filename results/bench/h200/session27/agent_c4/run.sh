#!/usr/bin/env bash
# Session 27 call 4 (issue 16): the long agent workload re-run with this session's prefill (cuDNN plans at start,
# causal squares), each system at its best concurrency from runs 3 and 5 (dense + radix S=5, SnapKV + chain S=32),
# against run 5's committed 2.46 / 5.96 turns/s; then dense prefill at 32K and 8K side by side with HF transformers.
OUT=$1; C=$2
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
COMMON=(python3 -m sparse_serve.cli bench-agent --commit "$C" --out $OUT/agent --num-kv-blocks 10240
  --max-num-batched-tokens 4096 --max-num-seqs 64 --turns 10 --system-tokens 1024 --task-tokens 512
  --tool-tokens 3072,3840 --output-tokens 128)
SNAPKV=(--sparse-method snapkv --sink-keep-tokens 64 --decode-keep-tokens 3520 --recent-keep-tokens 512)
timeout 100 "${COMMON[@]}" --sessions 5 --max-seconds 90 > $OUT/logs/dense.txt 2>&1
timeout 140 "${COMMON[@]}" --append --sessions 32 --max-seconds 130 "${SNAPKV[@]}" > $OUT/logs/snapkv.txt 2>&1
grep -E "^\| (dense|snapkv)|speedup" $OUT/agent/agent.md
A=(bench --no-progress --commit "$C" --out $OUT/pf --prefill real --batch-size 1 --output-len 4 --warmup-steps 1 --max-num-seqs 8)
timeout 120 python3 -m sparse_serve.cli "${A[@]}" --prompt-len 32768,8192 --hf-baseline --hf-steps 2 > $OUT/logs/pf.txt 2>&1
grep -A8 "^## Prefill" $OUT/pf/bench.md
(cd $OUT && tar czf all.tgz agent pf logs && rm -rf pf logs)
