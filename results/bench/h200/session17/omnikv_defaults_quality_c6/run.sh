#!/usr/bin/env bash
# Session 17 call 6: the new logits_attention / paged_logits defaults. GPU tests of the logits kernels and
# OmniKV on CUDA; dense / OmniKV-2048 (bf16) / OmniKV-2048 over fp8 at 128K side by side (defaults only);
# then quality of the composed methods on the embedded model (three processes side by side, 6 samples per cell).
set -x
OUT=$1; C=$2
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
timeout 120 python3 -m pytest -q -p no:cacheprovider packages/sparse-kernels/tests/test_logits_attention.py \
  packages/sparse-kernels/tests/test_paged_logits.py tests/test_quantized_kv_engine.py \
  -k "logits or attention or omnikv or head_max" > $OUT/gpu_tests.txt 2>&1
tail -3 $OUT/gpu_tests.txt
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --timed-steps 256 --max-num-seqs 64 --profile-steps 3 --out $OUT/engine)
O=(--sparse-method omnikv --sink-keep-tokens 64 --decode-keep-tokens 1472 --recent-keep-tokens 512)
timeout 90 "${B[@]}" --batch-size 5 > $OUT/dense.txt 2>&1; tail -1 $OUT/dense.txt
timeout 80 "${B[@]}" --append "${O[@]}" --batch-size 5 > $OUT/omnikv.txt 2>&1; tail -1 $OUT/omnikv.txt
timeout 120 "${B[@]}" --append "${O[@]}" --kv-cache-dtype fp8 --batch-size 5,max > $OUT/omnikv_fp8.txt 2>&1; tail -1 $OUT/omnikv_fp8.txt
grep -E "^\| (dense|omnikv)" $OUT/engine/bench.md
cd $OUT && tar czf engine.tgz engine && rm -rf engine && cd - > /dev/null
E=(python3 scripts/eval_kv_dtypes.py --set composed --device cuda --samples-per-cell 6)
timeout 250 "${E[@]}" --stores dense,quest,quest-fp8,quest-kivi4 --out $OUT/q1 > $OUT/q1.txt 2>&1 &
timeout 250 "${E[@]}" --stores dense,omnikv,omnikv-fp8 --out $OUT/q2 > $OUT/q2.txt 2>&1 &
timeout 250 "${E[@]}" --stores dense,snapkv,snapkv-fp8,snapkv-kivi4 --out $OUT/q3 > $OUT/q3.txt 2>&1 &
wait
for q in q1 q2 q3; do grep "^|" $OUT/$q.txt | head -8; done
cd $OUT && tar czf quality.tgz q1 q2 q3 q1.txt q2.txt q3.txt && rm -rf q1 q2 q3
