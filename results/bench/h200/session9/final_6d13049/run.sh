#!/usr/bin/env bash
# Session 9 call 3b: issue 15's decode numbers over the whole decode (2040 steps) after the batched eviction round:
# dense b5, SnapKV-8192 with decode-time eviction every 256 tokens at b5 and max, SnapKV without decode eviction at max;
# the fused split reduce A/B at max; CUDA engine tests of the batched round; one eviction round profiled at b91.
set -x
OUT=$1; C=$2
mkdir -p $OUT
timeout 100 python3 -m pytest -q -p no:cacheprovider packages/sparse-methods/tests/test_attention_batch.py tests/test_eviction_round.py tests/test_eviction_pipeline.py -k "cuda or CUDA" > $OUT/cuda_engine_tests.txt 2>&1; tail -2 $OUT/cuda_engine_tests.txt
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048)
S=(--sink-keep-tokens 64 --decode-keep-tokens 7616 --recent-keep-tokens 512)
timeout 100 "${B[@]}" --out $OUT/ev --batch-size 5 --timed-steps 2040 --profile-steps 3 --max-num-seqs 8 > $OUT/ev_log.txt 2>&1
timeout 200 "${B[@]}" --out $OUT/ev --append --sparse-method snapkv "${S[@]}" --decode-eviction-interval 256 --batch-size 5,max --timed-steps 2040 --profile-steps 3 --max-num-seqs 192 >> $OUT/ev_log.txt 2>&1
timeout 110 "${B[@]}" --out $OUT/ev --append --sparse-method snapkv "${S[@]}" --batch-size max --timed-steps 2040 --profile-steps 3 --max-num-seqs 192 >> $OUT/ev_log.txt 2>&1
grep "^|" $OUT/ev/bench.md | head -8
SPARSE_KERNELS_FUSED_REDUCE_MAX_SPLITS=2 timeout 70 "${B[@]}" --out $OUT/fused --sparse-method snapkv "${S[@]}" --batch-size max --timed-steps 256 --profile-steps 3 --max-num-seqs 192 > $OUT/fused_log.txt 2>&1
grep "^| snapkv" $OUT/fused/bench.md
M=packages/sparse-serve/src/sparse_serve/bench/configs/qwen3-8b
timeout 100 python3 benchmarks/eviction_step.py --model $M --device cuda --prompt-len 131072 --budget 64,7616,512 --window 32 --interval 64 --rounds 2 --torch-profile --batch 91 > $OUT/round_b91.txt 2>&1; tail -2 $OUT/round_b91.txt
python3 - <<PY
import json, statistics
for f in ("$OUT/ev/bench.json", "$OUT/fused/bench.json"):
    try: d = json.load(open(f))
    except Exception as e: print(f, e); continue
    for inv in d["invocations"]:
        for r in inv["runs"]:
            raw = r["raw"]; s = raw["step_seconds"]; med = statistics.median(s)
            big = [(i, round(x * 1e3)) for i, x in enumerate(s) if x > 3 * med]
            print(r["sparse_method"], raw["batch_size"], "median", round(med * 1e3, 2), "wall/step", round(raw["wall_seconds"] / len(s) * 1e3, 2), "busy", raw.get("gpu_kernel_ms_per_step"), "big", big[:12])
            print("   top", [(k["name"][:24], round(k["ms_per_step"], 3)) for k in raw.get("gpu_kernels_top", [])][:8])
PY
