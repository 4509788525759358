#!/usr/bin/env bash
# Session 25 call 3: the whole 2K decode at 128K x 5, side by side: dense, RetroInfer at its defaults (index updates
# after the graph replay, several layers' blocks in one k-means), SnapKV-8192 without and with decode-time eviction
# every 1024 tokens (each layer back to 8192 kept tokens), all with rope_store.
OUT=$1; C=$2
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --max-num-seqs 8
  --batch-size 5 --profile-steps 3 --timed-steps 2040 --out $OUT/whole)
SNAP=(--sparse-method snapkv --sink-keep-tokens 64 --decode-keep-tokens 7616 --recent-keep-tokens 512)
timeout 100 "${B[@]}" > $OUT/logs/dense.txt 2>&1
timeout 200 "${B[@]}" --append --sparse-method retroinfer > $OUT/logs/retro.txt 2>&1
timeout 60 "${B[@]}" --append "${SNAP[@]}" > $OUT/logs/snap.txt 2>&1
timeout 80 "${B[@]}" --append "${SNAP[@]}" --decode-eviction-interval 1024 > $OUT/logs/snap_1024.txt 2>&1
python3 results/bench/engine_summary.py $OUT/whole/bench.json --kernels 12 > $OUT/summary.txt 2>&1; cat $OUT/summary.txt
grep -h "^| \(dense\|snapkv\|retro\)" $OUT/whole/bench.md
tail -3 $OUT/logs/retro.txt
(cd $OUT && tar czf engine.tgz whole logs && rm -rf whole logs)
