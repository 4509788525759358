#!/usr/bin/env bash
# Session 19 call 1: GPU tests (host_threads on CUDA, page bounds / top-k after 946972d), then dense and the
# query-aware methods at 128K, batch 5, with the engine's default host_threads=1 (results/bench/run_h200_query_aware.sh).
set -x
OUT=$1; C=$2
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_host_threads.py packages/sparse-kernels/tests/test_decode_logits.py packages/sparse-kernels/tests/test_page_bounds.py \
  packages/sparse-kernels/tests/test_top_k_ascending.py tests/test_quantized_kv_engine.py tests/test_cuda_engine.py -k "not variants_property and (omnikv or host or logits or bounds or top_k or cuda)" > $OUT/gpu_tests.txt 2>&1
tail -4 $OUT/gpu_tests.txt
COMMIT=$C timeout 420 bash results/bench/run_h200_query_aware.sh $OUT/engine "omnikv omnikv_fp8 quest retroinfer" > $OUT/bench.txt 2>&1
tail -14 $OUT/bench.txt
python3 - <<PY
import json
d = json.load(open("$OUT/engine/bench.json"))
for inv in d["invocations"]:
    for r in inv["runs"]:
        raw, m = r["raw"], r["metrics"]
        st = raw.get("step_seconds") or []
        med = sorted(st)[len(st)//2] if st else 0
        print(r["sparse_method"], r.get("kv_store"), raw.get("batch_size"), "ms/step", round(m["ms_per_step"], 3), "tok/s", round(m["tokens_per_s"], 1), "GB/step", round(m["bytes_per_step"] / 1e9, 2), "copy", round(m.get("fraction_of_copy_bw", 0), 3), "busy", raw.get("gpu_kernel_ms_per_step"), "threads", raw.get("host_threads"), "long", sum(1 for s in st if s > 1.5*med))
        for k in raw.get("gpu_kernels_top", [])[:14]:
            print("   ", k["name"][:50], round(k["ms_per_step"], 4), k.get("calls_per_step"))
PY
(cd $OUT && tar czf engine.tgz engine && rm -rf engine)
