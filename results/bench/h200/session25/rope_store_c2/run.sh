#!/usr/bin/env bash
# Session 25 call 2: RetroInfer's index updates after the graph replay (38485c4) with several layers' blocks in one
# k-means (d0c9773), over the whole 2K decode; RoPE and the KV store in one launch (rope_store) against the two
# launches (unfusedwrap.py), dense and SnapKV-8192; Quest / OmniKV at the same commit; GPU tests of the changes.
OUT=$1; C=$2
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
timeout 200 python3 -m pytest -q -rf -p no:cacheprovider tests/test_retroinfer_engine.py tests/test_cuda_engine.py \
  packages/sparse-kernels/tests/test_rope.py packages/sparse-kernels/tests/test_rope_store.py \
  packages/sparse-methods/tests/test_retroinfer_index_blocks.py > $OUT/gpu_tests.txt 2>&1
grep -E "^FAILED|^ERROR|passed|failed" $OUT/gpu_tests.txt | tail -8
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --max-num-seqs 8
  --batch-size 5 --profile-steps 3)
U=(python3 unfusedwrap.py bench --no-progress --commit "$C+unfused" --prompt-len 131072 --output-len 2048 --max-num-seqs 8
  --batch-size 5 --profile-steps 3)
SNAP=(--sparse-method snapkv --sink-keep-tokens 64 --decode-keep-tokens 7616 --recent-keep-tokens 512)
QA=(--sink-keep-tokens 64 --decode-keep-tokens 1472 --recent-keep-tokens 512)
timeout 100 "${B[@]}" --timed-steps 2040 --out $OUT/whole > $OUT/logs/dense_whole.txt 2>&1
timeout 60 "${B[@]}" --timed-steps 2040 --out $OUT/whole --append "${SNAP[@]}" > $OUT/logs/snap_whole.txt 2>&1
timeout 70 "${B[@]}" --timed-steps 2040 --out $OUT/whole --append --sparse-method retroinfer > $OUT/logs/retro_whole.txt 2>&1
timeout 50 "${U[@]}" --timed-steps 256 --out $OUT/ab > $OUT/logs/dense_unfused.txt 2>&1
timeout 50 "${B[@]}" --timed-steps 256 --out $OUT/ab --append > $OUT/logs/dense_fused.txt 2>&1
timeout 40 "${U[@]}" --timed-steps 256 --out $OUT/ab --append "${SNAP[@]}" > $OUT/logs/snap_unfused.txt 2>&1
timeout 40 "${B[@]}" --timed-steps 256 --out $OUT/ab --append "${SNAP[@]}" > $OUT/logs/snap_fused.txt 2>&1
timeout 40 "${B[@]}" --timed-steps 256 --out $OUT/ab --append --sparse-method quest "${QA[@]}" > $OUT/logs/quest.txt 2>&1
timeout 40 "${B[@]}" --timed-steps 256 --out $OUT/ab --append --sparse-method omnikv "${QA[@]}" > $OUT/logs/omnikv.txt 2>&1
(python3 results/bench/engine_summary.py $OUT/whole/bench.json --kernels 8
 python3 results/bench/engine_summary.py $OUT/ab/bench.json --kernels 6) > $OUT/summary.txt 2>&1; cat $OUT/summary.txt
grep -h "^| \(dense\|snapkv\|quest\|omnikv\|retro\)" $OUT/whole/bench.md $OUT/ab/bench.md
(cd $OUT && tar czf engine.tgz ab whole logs && rm -rf ab whole logs)
