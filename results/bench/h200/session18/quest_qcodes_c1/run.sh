#!/usr/bin/env bash
# Session 18 call 1: GPU tests (OmniKV over TurboQuant, never run on a GPU; int8-query page bounds and bf16
# top-k; Quest engine paths), the selection probe (page bounds / top-k / chains old vs new), then dense and
# Quest-2048 at 128K, batch 5, side by side.
set -x
OUT=$1; C=$2
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
timeout 200 python3 -m pytest -q -p no:cacheprovider -x packages/sparse-kernels/tests/test_logits_attention.py \
  packages/sparse-kernels/tests/test_paged_logits.py packages/sparse-kernels/tests/test_page_bounds.py \
  packages/sparse-kernels/tests/test_top_k_ascending.py tests/test_quantized_kv_engine.py tests/test_cuda_engine.py \
  tests/test_mla_quest.py -k "not variants_property" > $OUT/gpu_tests.txt 2>&1
tail -5 $OUT/gpu_tests.txt
timeout 100 python3 benchmarks/quest_select_probe.py --batches 5,10 --no-sweep \
  --top-k-variants "serial (default),packed b4,packed b2 t1024,packed b4 t1024,packed b2 t2048" --json $OUT/probe.json > $OUT/probe.txt 2>&1
grep -E "page_bounds|graph|top-k|^  " $OUT/probe.txt | head -60
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --timed-steps 256 --max-num-seqs 64 --profile-steps 3 --out $OUT/engine)
Q=(--sparse-method quest --sink-keep-tokens 64 --decode-keep-tokens 1472 --recent-keep-tokens 512)
timeout 100 "${B[@]}" --batch-size 5 > $OUT/dense.txt 2>&1; tail -1 $OUT/dense.txt
timeout 90 "${B[@]}" --append "${Q[@]}" --batch-size 5 > $OUT/quest.txt 2>&1; tail -1 $OUT/quest.txt
grep -E "^\| (dense|quest)" $OUT/engine/bench.md
python3 - <<PY
import json
d = json.load(open("$OUT/engine/bench.json"))
for inv in d["invocations"]:
    for r in inv["runs"]:
        raw, m = r["raw"], r["metrics"]
        print(r["sparse_method"], r.get("kv_store"), raw.get("batch_size"), "ms/step", round(m["ms_per_step"], 3), "tok/s", round(m["tokens_per_s"], 1), "GB/step", round(m["bytes_per_step"] / 1e9, 2), "copy", round(m.get("fraction_of_copy_bw", 0), 3), "busy", raw.get("gpu_kernel_ms_per_step"), "graphs", raw.get("cuda_graph_steps"))
        for k in raw.get("gpu_kernels_top", [])[:12]:
            print("   ", k["name"][:50], round(k["ms_per_step"], 4), k.get("calls_per_step"))
PY
cd $OUT && tar czf engine.tgz engine && rm -rf engine
