#!/usr/bin/env bash
# Session 17 call 5: the fp8 filter-layer kernels' launch shapes (logits_fp8_probe.py), then OmniKV-2048
# over fp8 at 128K with the best shapes patched in, side by side with dense and OmniKV over bf16.
set -x
OUT=$1; C=$2
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
timeout 300 python3 packages/sparse-kernels/benchmarks/logits_fp8_probe.py --batches 5,11 > $OUT/probe.jsonl 2> $OUT/probe.err
tail -2 $OUT/probe.err
python3 pick.py $OUT/probe.jsonl $OUT/best.json
export BEST_JSON=$OUT/best.json
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --timed-steps 256 --max-num-seqs 64 --profile-steps 3 --out $OUT/engine)
W=(python3 benchwrap.py bench --no-progress --commit "$C+fp8pick" --prompt-len 131072 --output-len 2048 --timed-steps 256 --max-num-seqs 64 --profile-steps 3 --out $OUT/engine)
O=(--sparse-method omnikv --sink-keep-tokens 64 --decode-keep-tokens 1472 --recent-keep-tokens 512)
timeout 100 "${B[@]}" --batch-size 5 > $OUT/dense.txt 2>&1; tail -1 $OUT/dense.txt
timeout 100 "${B[@]}" --append "${O[@]}" --batch-size 5 > $OUT/omnikv.txt 2>&1; tail -1 $OUT/omnikv.txt
timeout 150 "${W[@]}" --append "${O[@]}" --kv-cache-dtype fp8 --batch-size 5,max > $OUT/omnikv_fp8.txt 2>&1; tail -1 $OUT/omnikv_fp8.txt
grep -E "^\| (dense|omnikv)" $OUT/engine/bench.md
python3 - <<PY
import json
d = json.load(open("$OUT/engine/bench.json"))
for inv in d["invocations"]:
    for r in inv["runs"]:
        raw, m = r["raw"], r["metrics"]
        print(r["sparse_method"], r.get("kv_store"), raw.get("batch_size"), "ms/step", round(m["ms_per_step"], 3), "tok/s", round(m["tokens_per_s"], 1), "copy", round(m.get("fraction_of_copy_bw", 0), 3), "busy", raw.get("gpu_kernel_ms_per_step"))
        for k in raw.get("gpu_kernels_top", [])[:6]:
            print("   ", k["name"][:50], round(k["ms_per_step"], 4), k.get("calls_per_step"))
PY
cd $OUT && tar czf engine.tgz engine && rm -rf engine
