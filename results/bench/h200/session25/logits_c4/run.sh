#!/usr/bin/env bash
# Session 25 call 4: cluster_logits' launch shapes at RetroInfer's decode shape (one-warp programs included), then the
# engine side by side at 128K x 5: dense (256 steps), RetroInfer at the defaults and with the best shape patched in
# (logitswrap.py), each over the whole 2K decode.
OUT=$1; C=$2
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
timeout 100 python3 logits_sweep.py $OUT > $OUT/logs/sweep.txt 2>&1; tail -2 $OUT/logs/sweep.txt
export BEST_JSON=$OUT/best.json
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --max-num-seqs 8
  --batch-size 5 --profile-steps 3 --out $OUT/engine)
W=(python3 logitswrap.py bench --no-progress --commit "$C+logits" --prompt-len 131072 --output-len 2048 --max-num-seqs 8
  --batch-size 5 --profile-steps 3 --out $OUT/engine)
timeout 60 "${B[@]}" --timed-steps 256 > $OUT/logs/dense.txt 2>&1
timeout 150 "${W[@]}" --append --sparse-method retroinfer --timed-steps 2040 > $OUT/logs/retro_best.txt 2>&1
timeout 150 "${B[@]}" --append --sparse-method retroinfer --timed-steps 2040 > $OUT/logs/retro.txt 2>&1
python3 results/bench/engine_summary.py $OUT/engine/bench.json --kernels 6 > $OUT/summary.txt 2>&1; cat $OUT/summary.txt
grep -h "^| \(dense\|retro\)" $OUT/engine/bench.md
(cd $OUT && tar czf engine.tgz engine logs && rm -rf engine logs)
