#!/usr/bin/env bash
# Session 24 call 1: small-M linear weight prefetch to L2 before the PDL wait, and early release of dependents
# (linear: 'rel'; RoPE/store/reduce: 'small'). Whole-step probe at b5, 8K and 128K; then the engine at 128K x 5,
# dense and SnapKV-8192, default and the probe's best variant at 8K.
OUT=$1; C=$2
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
export PYTHONPATH=$PYTHONPATH:$PWD/packages/sparse-kernels/benchmarks
V=pf512,pf1024,pf2048,rel,small,rel+small,pf1024+small,pf1024+rel,pf1024+rel+small,pf2048+rel+small,pf4096+rel+small
timeout 240 python3 packages/sparse-kernels/benchmarks/decode_step_probe.py --batch 5 --kv-len 8192,131072 --per-sm 4 \
  --no-pdl-off --pdl-variants $V --json $OUT/probe.json > $OUT/probe.txt 2>&1; cat $OUT/probe.txt
BEST=$(python3 - $OUT/probe.json <<'PY'
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["rows"] if r["kv_len"] == 8192 and " fused " in r["variant"]]
print(min(rows, key=lambda r: r["ms"])["variant"].split(" fused ")[1] if rows else "pf1024+rel+small")
PY
)
echo "best at 8K: $BEST"
B=(python3 pdlwrap.py bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --max-num-seqs 8
  --batch-size 5 --profile-steps 3 --timed-steps 256 --out $OUT/engine)
SNAP=(--sparse-method snapkv --sink-keep-tokens 64 --decode-keep-tokens 7616 --recent-keep-tokens 512)
timeout 80 "${B[@]}" > $OUT/dense.txt 2>&1
timeout 60 "${B[@]}" --append "${SNAP[@]}" > $OUT/snap.txt 2>&1
PDL_SPEC=$BEST timeout 80 "${B[@]}" --append --commit "$C+$BEST" > $OUT/dense_best.txt 2>&1
PDL_SPEC=$BEST timeout 60 "${B[@]}" --append --commit "$C+$BEST" "${SNAP[@]}" > $OUT/snap_best.txt 2>&1
python3 results/bench/engine_summary.py $OUT/engine/bench.json --kernels 9
(cd $OUT && tar czf engine.tgz engine && rm -rf engine)
