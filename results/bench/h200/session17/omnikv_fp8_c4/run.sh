#!/usr/bin/env bash
# Session 17 call 4: OmniKV over fp8 (filter layers' logits and attention from codes). GPU tests of the
# kernels and of every quantized store under CUDA graphs, then dense / OmniKV-2048 / OmniKV-2048 over fp8
# at 128K side by side.
set -x
OUT=$1; C=$2
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
timeout 330 python3 -m pytest -q -p no:cacheprovider packages/sparse-kernels/tests/test_logits_attention.py \
  packages/sparse-kernels/tests/test_paged_logits.py packages/sparse-kernels/tests/test_quantized_decode.py \
  packages/sparse-kernels/tests/test_page_bounds.py packages/sparse-kernels/tests/test_block_summary.py \
  tests/test_quantized_kv_engine.py tests/test_cuda_engine.py > $OUT/gpu_tests.txt 2>&1
tail -5 $OUT/gpu_tests.txt
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --timed-steps 256 --max-num-seqs 64 --profile-steps 3 --out $OUT/engine)
O=(--sparse-method omnikv --sink-keep-tokens 64 --decode-keep-tokens 1472 --recent-keep-tokens 512)
timeout 120 "${B[@]}" --batch-size 5 > $OUT/dense.txt 2>&1; tail -1 $OUT/dense.txt
timeout 100 "${B[@]}" --append "${O[@]}" --batch-size 5 > $OUT/omnikv.txt 2>&1; tail -1 $OUT/omnikv.txt
timeout 150 "${B[@]}" --append "${O[@]}" --kv-cache-dtype fp8 --batch-size 5,max > $OUT/omnikv_fp8.txt 2>&1; tail -1 $OUT/omnikv_fp8.txt
grep -E "^\| (dense|omnikv)" $OUT/engine/bench.md
python3 - <<PY
import json
d = json.load(open("$OUT/engine/bench.json"))
for inv in d["invocations"]:
    for r in inv["runs"]:
        raw, m = r["raw"], r["metrics"]
        print(r["sparse_method"], r.get("kv_store"), raw.get("batch_size"), "ms/step", round(m["ms_per_step"], 3), "tok/s", round(m["tokens_per_s"], 1), "GB/step", round(m["bytes_per_step"] / 1e9, 2), "copy", round(m.get("fraction_of_copy_bw", 0), 3), "busy", raw.get("gpu_kernel_ms_per_step"), "graphs", raw.get("cuda_graph_steps"))
        for k in raw.get("gpu_kernels_top", [])[:10]:
            print("   ", k["name"][:50], round(k["ms_per_step"], 4), k.get("calls_per_step"))
PY
cd $OUT && tar czf engine.tgz engine && rm -rf engine
