#!/usr/bin/env bash
# Session 14 call 5: where a SnapKV-8192 eviction round goes at batch 5 on the H200 (Qwen3-8B shape, 128K prompts
# held at 8192, interval 256): host cProfile and torch.profiler of one eviction step.
set -x
OUT=$1
mkdir -p $OUT
timeout 210 python3 benchmarks/eviction_step.py --model packages/sparse-serve/src/sparse_serve/bench/configs/qwen3-8b --device cuda --batch 5 --prompt-len 131072 --budget 64,7616,512 --window 32 --interval 256 --rounds 2 --profile 1 --profile-sort tottime --torch-profile > $OUT/round_b5.txt 2>&1
grep -v -i warn $OUT/round_b5.txt | tail -120
