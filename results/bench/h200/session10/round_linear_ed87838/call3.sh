#!/usr/bin/env bash
# Session 10 call 3: the eviction round's kernels (compaction, selection) old vs new; the small-M linear's split-K sweep
# at 5 rows; a decode launch-config sweep at batch 5 x 8448; GPU tests; engine: SnapKV b91 interval 256 (two rounds) and
# b5 with the linear's best split-K configs patched in vs default.
set -x
OUT=$1; C=$2
mkdir -p $OUT
export PYTHONPATH=$PYTHONPATH:packages/sparse-kernels/benchmarks
timeout 100 python3 -m pytest -q -p no:cacheprovider packages/sparse-kernels/tests/test_compact.py packages/sparse-kernels/tests/test_linear.py packages/sparse-kernels/tests/test_decode_buffers.py packages/sparse-methods/tests/test_scoring.py > $OUT/gpu_tests.txt 2>&1; tail -2 $OUT/gpu_tests.txt
timeout 120 python3 benchmarks/eviction_round_kernels.py --batches 91,5 --json $OUT/round_kernels.json > $OUT/round_kernels.txt 2>&1; grep -v "^{" $OUT/round_kernels.txt | tail -40
timeout 120 python3 packages/sparse-kernels/benchmarks/small_m_linear.py --rows 5 --shapes qkv,o,down,gate_up --split-k 2,3,4,6 --json $OUT/splitk.json > $OUT/splitk.txt 2>&1; grep -A40 "^shape" $OUT/splitk.txt
timeout 100 python3 packages/sparse-kernels/benchmarks/decode_bandwidth.py --kv-len 8448 --cases 5x16 --json $OUT/cfg_5x8448.json > $OUT/cfg_5x8448.txt 2>&1; grep -v "^{" $OUT/cfg_5x8448.txt | tail -10
python3 - > $OUT/best_linear.py <<PY
import json
rows = json.load(open("$OUT/splitk.json"))["rows"]
best = {}
for r in rows:
    if "BLOCK_N" not in r or r["max_diff"] > 0.05: continue
    key = (r["n"], r["k"])
    if key not in best or r["us"] < best[key]["us"]: best[key] = r
cfgs = {k: {f: v[f] for f in ("USE_DOT", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages") } | {"SPLIT_K": v.get("SPLIT_K", 1)} for k, v in best.items()}
print("BEST =", repr(cfgs))
PY
cat $OUT/best_linear.py
cat > $OUT/patched.py <<PY
import sys
exec(open("$OUT/best_linear.py").read())
import sparse_kernels.linear as L
orig = L.linear_config
def cfg(rows, n, k):
    return dict(BEST[(n, k)]) if rows <= 16 and (n, k) in BEST else orig(rows, n, k)
L.linear_config = cfg
from sparse_serve.cli import main
main(sys.argv[1:])
PY
B=(bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --sparse-method snapkv --sink-keep-tokens 64 --decode-keep-tokens 7616 --recent-keep-tokens 512 --max-num-seqs 192)
timeout 100 python3 -m sparse_serve.cli "${B[@]}" --out $OUT/eng --batch-size 5 --timed-steps 200 --profile-steps 3 > $OUT/eng_log.txt 2>&1
timeout 100 python3 $OUT/patched.py "${B[@]}" --out $OUT/eng --append --batch-size 5 --timed-steps 200 --profile-steps 3 >> $OUT/eng_log.txt 2>&1
timeout 100 python3 $OUT/patched.py bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --max-num-seqs 8 --out $OUT/eng --append --batch-size 5 --timed-steps 100 --profile-steps 3 >> $OUT/eng_log.txt 2>&1
timeout 150 python3 -m sparse_serve.cli "${B[@]}" --out $OUT/eng --append --decode-eviction-interval 256 --batch-size max --timed-steps 530 --profile-steps 3 >> $OUT/eng_log.txt 2>&1
tail -3 $OUT/eng_log.txt
python3 - <<PY
import json, statistics
d = json.load(open("$OUT/eng/bench.json"))
for inv in d["invocations"]:
    for r in inv["runs"]:
        raw = r["raw"]; s = raw["step_seconds"]; med = statistics.median(s)
        big = [(i, round(x * 1e3)) for i, x in enumerate(s) if x > 3 * med]
        print(r["sparse_method"], raw["batch_size"], "median", round(med * 1e3, 2), "wall/step", round(raw["wall_seconds"] / len(s) * 1e3, 2), "busy", raw.get("gpu_kernel_ms_per_step"), "big", big[:10])
        print("   top", [(k["name"][:24], round(k["ms_per_step"], 3)) for k in raw.get("gpu_kernels_top", [])][:9])
PY
