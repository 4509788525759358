set -x
OUT=$1; COMMIT=$2
mkdir -p $OUT
K=packages/sparse-kernels/benchmarks
CFGS=32:1:3:16,32:1:3:32,64:1:3:16,64:1:3:32,64:2:3:8,64:2:3:16,32:2:3:8
(cd $K && timeout 100 python3 decode_bandwidth.py --kv-len 131072 --cases 5x1 --configs $CFGS --json $OUT/dec128k.json) > $OUT/dec128k.txt 2>&1
(cd $K && timeout 100 python3 decode_bandwidth.py --kv-len 8448 --cases 5x16,76x1 --configs $CFGS --json $OUT/dec8k.json) > $OUT/dec8k.txt 2>&1
tail -22 $OUT/dec8k.txt; tail -12 $OUT/dec128k.txt
timeout 150 python3 benchmarks/quest_select_probe.py --batches 5 --json $OUT/quest_select.json > $OUT/quest_select.txt 2>&1
grep -E "cfg|logits|bounds" $OUT/quest_select.txt | head -40
(cd $K && timeout 120 python3 quantized_decode_bandwidth.py --batches 4,16 --budget 100 --jsonl $OUT/qdec.jsonl) > $OUT/qdec.txt 2>&1
echo '{"fp8": {"BLOCK_N": 128, "num_warps": 4, "num_stages": 2}}' > $OUT/old_fp8.json
B=(python3 -m sparse_serve.cli bench --no-progress --commit $COMMIT --prompt-len 131072 --output-len 2048 --timed-steps 32 --max-num-seqs 64 --profile-steps 3 --out $OUT/engine)
"${B[@]}" --sparse-method fp8_kv --batch-size max > $OUT/fp8_new.log 2>&1
BEST_JSON=$OUT/old_fp8.json python3 benchwrap.py bench --no-progress --commit $COMMIT+oldfp8 --prompt-len 131072 --output-len 2048 --timed-steps 32 --max-num-seqs 64 --profile-steps 3 --out $OUT/engine --append --sparse-method fp8_kv --batch-size max > $OUT/fp8_old.log 2>&1
grep -E "^\| fp8" $OUT/engine/bench.md
python3 - $OUT/engine/bench.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for inv in d["invocations"]:
    for r in inv["runs"]:
        print(r["batch_size"], r["metrics"]["ms_per_step"], [(k["name"], round(k["ms_per_step"], 3), k["calls_per_step"]) for k in r["raw"]["gpu_kernels_top"][:8]])
PY
cd $OUT && tar -czf all.tgz *.txt *.json *.jsonl *.log engine && rm -rf engine *.log
