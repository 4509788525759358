set -x
OUT=$1; COMMIT=$2
mkdir -p $OUT
timeout 150 python3 fp8_probe.py $OUT/probe.jsonl > $OUT/probe.log 2>&1
tail -2 $OUT/probe.log
export BEST_JSON=$OUT/best.json
B=(python3 -m sparse_serve.cli bench --no-progress --commit $COMMIT --prompt-len 131072 --output-len 2048 --timed-steps 32 --out $OUT/engine)
W=(python3 benchwrap.py bench --no-progress --commit $COMMIT+fp8pick --prompt-len 131072 --output-len 2048 --timed-steps 32 --out $OUT/engine)
"${B[@]}" --batch-size 5 --max-num-seqs 64 > $OUT/dense.log 2>&1
"${B[@]}" --append --sparse-method fp8_kv --batch-size 5,max --max-num-seqs 64 > $OUT/fp8.log 2>&1
"${W[@]}" --append --sparse-method fp8_kv --batch-size 5,max --max-num-seqs 64 > $OUT/fp8_pick.log 2>&1
"${B[@]}" --append --sparse-method kivi --kivi-bits 4 --batch-size 5,max --max-num-seqs 64 > $OUT/kivi4.log 2>&1
"${B[@]}" --append --sparse-method kivi --kivi-bits 2 --batch-size 5,max --max-num-seqs 64 > $OUT/kivi2.log 2>&1
grep -E "^\| (dense|fp8|kivi)" $OUT/engine/bench.md
SNAP=(--sparse-method snapkv --sink-keep-tokens 64 --decode-keep-tokens 7616 --recent-keep-tokens 512 --batch-size max --max-num-seqs 192)
"${B[@]}" --append "${SNAP[@]}" > $OUT/snap.log 2>&1
"${W[@]}" --append "${SNAP[@]}" --kv-cache-dtype fp8 > $OUT/snap_fp8.log 2>&1
grep -E "^\| (dense|fp8|kivi|snapkv)" $OUT/engine/bench.md
grep -A30 "Aggregate" $OUT/engine/bench.md
