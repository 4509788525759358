#!/usr/bin/env bash
# Session 28 call 1 (issue 15): GPU tests of the eviction round observed after the forward (the decode graph replays
# at a round); the first decode-time round of SnapKV-8192 at batch 5 (128K) under cProfile with every step timed
# (firstround.py); then the whole 2K decode at 128K x 5 side by side: dense, SnapKV-8192 without decode-time
# eviction, every 1024 and every 256 decode tokens.
OUT=$1; C=$2
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
timeout 150 python3 -m pytest -q -x -p no:cacheprovider "tests/test_eviction_pipeline.py::test_cuda_decode_eviction_graphs_pipelined_equal_synchronous" \
  tests/test_cuda_engine.py tests/test_eviction_round.py 2>&1 | tail -4 | tee $OUT/tests.txt
SNAP=(--sparse-method snapkv --sink-keep-tokens 64 --decode-keep-tokens 7616 --recent-keep-tokens 512)
PROF_OUT=$OUT/first PROF_LO=252 PROF_HI=258 timeout 90 python3 firstround.py bench --no-progress --commit "$C" --prompt-len 131072 \
  --output-len 600 --max-num-seqs 5 --batch-size 5 --timed-steps 580 --out $OUT/logs/first "${SNAP[@]}" --decode-eviction-interval 256 > $OUT/logs/first.txt 2>&1
tail -2 $OUT/logs/first.txt
python3 -c "
import json; d=json.load(open('$OUT/first.steps.json')); r=d['rounds']; s=d['steps_ms']
print('rounds', r, 'ms', [s[i] for i in r if i < len(s)], 'next', [s[i+1] for i in r if i+1 < len(s)])
m=sorted(s[5:]); print('median step', m[len(m)//2])"
head -60 $OUT/first.host.txt | cut -c1-200
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --max-num-seqs 8
  --batch-size 5 --profile-steps 3 --timed-steps 2040 --out $OUT/whole)
timeout 110 "${B[@]}" > $OUT/logs/dense.txt 2>&1
timeout 60 "${B[@]}" --append "${SNAP[@]}" > $OUT/logs/snap.txt 2>&1
timeout 70 "${B[@]}" --append "${SNAP[@]}" --decode-eviction-interval 1024 > $OUT/logs/snap_1024.txt 2>&1
timeout 70 "${B[@]}" --append "${SNAP[@]}" --decode-eviction-interval 256 > $OUT/logs/snap_256.txt 2>&1
python3 results/bench/engine_summary.py $OUT/whole/bench.json --kernels 6 > $OUT/summary.txt 2>&1; cut -c1-300 $OUT/summary.txt
grep -h "^| \(dense\|snapkv\)" $OUT/whole/bench.md | cut -c1-250
grep -h "x\*\*" $OUT/whole/bench.md | head
(cd $OUT && tar czf all.tgz whole logs && rm -rf whole logs)
