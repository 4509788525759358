#!/usr/bin/env bash
# Session 27 call 6 (issue 14): KIVI's codes unpacked in PTX pairs (PAIRS). GPU tests of the quantized decode with
# the switch on; the kernel probe (KIVI-4 / KIVI-2 at batch 16, 128K, one layer: default, then PAIRS variants side by
# side); the engine's KIVI-4 at its largest batch with PAIRS (call 1 at f2d9a56 ran it without).
OUT=$1; C=$2
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
SPARSE_KERNELS_KIVI_PAIRS=1 timeout 80 python3 -m pytest -q -x -m "gpu or not gpu" -p no:cacheprovider \
  packages/sparse-kernels/tests/test_quantized_decode.py packages/sparse-kernels/tests/test_decode_logits.py 2>&1 | tail -3 | tee $OUT/tests.txt
timeout 80 python3 packages/sparse-kernels/benchmarks/quantized_decode_bandwidth.py --budget 35 --batches 16 \
  --schemes kivi:4,kivi:2 --jsonl $OUT/qdecode.jsonl > $OUT/logs/qdecode16.txt 2>&1
grep -v "^{" $OUT/logs/qdecode16.txt | tail -5
grep '"config": {' $OUT/qdecode.jsonl | cut -c1-220
export SPARSE_KERNELS_KIVI_PAIRS=1
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$C+pairs" --prompt-len 131072 --output-len 2048 --max-num-seqs 64
  --profile-steps 3 --out $OUT/engine)
timeout 95 "${B[@]}" --sparse-method kivi --kivi-bits 4 --batch-size max --timed-steps 32 > $OUT/logs/kivi4.txt 2>&1
python3 results/bench/engine_summary.py $OUT/engine/bench.json --kernels 4 > $OUT/summary.txt 2>&1; cat $OUT/summary.txt
(cd $OUT && tar czf all.tgz engine logs && rm -rf engine logs)
