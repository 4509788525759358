#!/usr/bin/env bash
# Session 26 call 3: SnapKV-8192 at dense's batch over the whole 2K decode, with decode-time eviction every 1024 /
# 512 tokens, after a short untimed SnapKV run with eviction in the same machine (Triton's kernel cache warm: the
# eviction kernels' first compilation took 2.9 s of session 25's timed window), side by side with dense.
OUT=$1; C=$2
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --max-num-seqs 8
  --batch-size 5 --profile-steps 3 --timed-steps 2040)
SNAP=(--sparse-method snapkv --sink-keep-tokens 64 --decode-keep-tokens 7616 --recent-keep-tokens 512)
timeout 60 python3 $(dirname $0)/cudnn_probe.py > $OUT/cudnn.txt 2>&1; cat $OUT/cudnn.txt
timeout 60 python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 300 --max-num-seqs 8 \
  --batch-size 5 --timed-steps 20 --warmup-steps 270 --out $OUT/warm "${SNAP[@]}" --decode-eviction-interval 256 > $OUT/logs/warm.txt 2>&1
tail -2 $OUT/logs/warm.txt
timeout 100 "${B[@]}" --out $OUT/whole > $OUT/logs/dense.txt 2>&1
timeout 70 "${B[@]}" --out $OUT/whole --append "${SNAP[@]}" --decode-eviction-interval 1024 > $OUT/logs/snap_1024.txt 2>&1
timeout 70 "${B[@]}" --out $OUT/whole --append "${SNAP[@]}" --decode-eviction-interval 512 > $OUT/logs/snap_512.txt 2>&1
python3 results/bench/engine_summary.py $OUT/whole/bench.json --kernels 12 > $OUT/summary.txt 2>&1; cat $OUT/summary.txt | head -60
grep -h "^| \(dense\|snapkv\)" $OUT/whole/bench.md
(cd $OUT && tar czf engine.tgz whole warm logs && rm -rf whole warm logs)
