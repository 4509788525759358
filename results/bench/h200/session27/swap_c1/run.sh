#!/usr/bin/env bash
# Session 27 call 1 (issue 14): the transposed quantized decode dots (SWAP_AB) timed. Kernel probe (both orders, side
# by side, batches 5 and 16) and the engine: dense at batch 5, then fp8_kv / KIVI-4 / KIVI-2 with SWAP_AB=1 at
# dense's batch and their own largest (session 25's runs of the same at f1beae9 are the transposed-off baseline).
OUT=$1; C=$2
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
timeout 150 python3 packages/sparse-kernels/benchmarks/quantized_decode_bandwidth.py --budget 110 --batches 5,16 --jsonl $OUT/qdecode.jsonl > $OUT/qdecode.txt 2>&1
grep -v '^{' $OUT/qdecode.txt | tail -30
python3 - $OUT/qdecode.jsonl <<'PY'
import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l); print({k:r[k] for k in r if k not in ('check',)})
PY
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --max-num-seqs 64
  --profile-steps 3 --out $OUT/engine)
timeout 80 "${B[@]}" --batch-size 5 --timed-steps 128 > $OUT/dense.txt 2>&1
export SPARSE_KERNELS_SWAP_AB=1
timeout 110 "${B[@]}" --commit "$C+swap" --append --sparse-method kivi --kivi-bits 4 --batch-size 5,max --timed-steps 48 > $OUT/kivi4.txt 2>&1
timeout 110 "${B[@]}" --commit "$C+swap" --append --sparse-method fp8_kv --batch-size 5,max --timed-steps 64 > $OUT/fp8.txt 2>&1
timeout 110 "${B[@]}" --commit "$C+swap" --append --sparse-method kivi --kivi-bits 2 --batch-size 5,max --timed-steps 32 > $OUT/kivi2.txt 2>&1
python3 results/bench/engine_summary.py $OUT/engine/bench.json --kernels 6 > $OUT/summary.txt; cat $OUT/summary.txt
tail -3 $OUT/*.txt | cut -c1-300
(cd $OUT && tar czf engine.tgz engine *.txt && rm -rf engine dense.txt fp8.txt kivi4.txt kivi2.txt)
