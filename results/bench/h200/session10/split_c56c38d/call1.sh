#!/usr/bin/env bash
# Session 10 call 1: decode split target at the eviction shapes (8448 / 10240 tokens) and the engine at b91 with the best.
set -x
OUT=$1; C=$2
mkdir -p $OUT
export PYTHONPATH=$PYTHONPATH:packages/sparse-kernels/benchmarks
D=packages/sparse-kernels/benchmarks/decode_bandwidth.py
timeout 120 python3 $D --kv-len 8448 --cases 91x1,76x1 --per-sm 1,2,4,6,12,16,24,32 --json $OUT/split_8448.json > $OUT/split_8448.txt 2>&1
grep -v "^{" $OUT/split_8448.txt
timeout 60 python3 $D --kv-len 10240 --cases 76x1,5x16 --per-sm 2,4,16 --json $OUT/split_10240.json > $OUT/split_10240.txt 2>&1
grep -v "^{" $OUT/split_10240.txt
BEST=$(python3 -c "
import json; rows=[r for r in json.load(open('$OUT/split_8448.json'))['rows'] if r['batch']==91]
print(min(rows, key=lambda r: r['us'])['programs_per_sm'])")
echo "best per_sm at b91: $BEST"
ARGS="'bench','--no-progress','--commit','$C','--prompt-len','131072','--output-len','2048','--sparse-method','snapkv','--sink-keep-tokens','64','--decode-keep-tokens','7616','--recent-keep-tokens','512','--decode-eviction-interval','256','--batch-size','max','--timed-steps','120','--profile-steps','3','--max-num-seqs','192'"
for PS in 8 $BEST 16; do
timeout 120 python3 -c "
import sparse_kernels._decode_buffers as b; b.PROGRAMS_PER_SM=$PS
from sparse_serve.cli import main; main([$ARGS,'--out','$OUT/eng_$PS'])" > $OUT/eng_$PS.txt 2>&1
python3 - <<PY
import json, statistics
d = json.load(open("$OUT/eng_$PS/bench.json"))
for inv in d["invocations"]:
    for r in inv["runs"]:
        raw = r["raw"]; s = raw["step_seconds"]
        print("per_sm $PS batch", raw["batch_size"], "median", round(statistics.median(s) * 1e3, 2), "busy", raw.get("gpu_kernel_ms_per_step"))
        print("   top", [(k["name"][:24], round(k["ms_per_step"], 3)) for k in raw.get("gpu_kernels_top", [])][:6])
PY
done
