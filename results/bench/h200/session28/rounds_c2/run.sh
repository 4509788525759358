#!/usr/bin/env bash
# Session 28 call 2 (issue 15): GPU tests of the one-kernel keep selection (top_k_ascending) and the eviction rounds;
# then the whole 2K decode at 128K x 5 side by side: dense, SnapKV-8192 without decode-time eviction, every 256 and
# every 512 decode tokens (the bench now runs one untimed round of the same batch first).
OUT=$1; C=$2
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
timeout 110 python3 -m pytest -q -x -p no:cacheprovider packages/sparse-methods/tests/test_scoring.py tests/test_batched_eviction.py \
  tests/test_eviction_round.py "tests/test_eviction_pipeline.py::test_cuda_decode_eviction_graphs_pipelined_equal_synchronous" 2>&1 | tail -3 | tee $OUT/tests.txt
SNAP=(--sparse-method snapkv --sink-keep-tokens 64 --decode-keep-tokens 7616 --recent-keep-tokens 512)
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --max-num-seqs 8
  --batch-size 5 --profile-steps 3 --timed-steps 2040 --out $OUT/whole)
timeout 110 "${B[@]}" > $OUT/logs/dense.txt 2>&1
timeout 60 "${B[@]}" --append "${SNAP[@]}" > $OUT/logs/snap.txt 2>&1
timeout 80 "${B[@]}" --append "${SNAP[@]}" --decode-eviction-interval 256 > $OUT/logs/snap_256.txt 2>&1
timeout 80 "${B[@]}" --append "${SNAP[@]}" --decode-eviction-interval 512 > $OUT/logs/snap_512.txt 2>&1
python3 results/bench/engine_summary.py $OUT/whole/bench.json --kernels 4 > $OUT/summary.txt 2>&1; cut -c1-300 $OUT/summary.txt
grep -h "^| \(dense\|snapkv\)" $OUT/whole/bench.md | cut -c1-250
grep -h "x\*\*" $OUT/whole/bench.md | head
python3 -c "
import json; d=json.load(open('$OUT/whole/bench.json'))
for inv in d['invocations']:
    for r in inv['runs']:
        raw=r['raw']; s=raw['step_seconds']; print(r.get('method', r.get('sparse_method')), 'warm', raw.get('warm_round_steps'), 'steps>12ms', [(i, round(1e3*x,1)) for i,x in enumerate(s) if x>0.012][:12])
"
tail -3 $OUT/logs/snap_256.txt
(cd $OUT && tar czf all.tgz whole logs && rm -rf whole logs)
