#!/usr/bin/env bash
# Session 10 call 4: issue 15's decode numbers over the whole decode (2040 steps) at this commit: dense b5; SnapKV-8192
# with decode-time eviction every 256 at max (after one warm-up run that fills Triton's on-disk kernel cache, as a
# restarted server finds it) and at b5; SnapKV without decode eviction at b5; Quest-2048 at b5 (128 steps); GPU tests.
set -x
OUT=$1; C=$2
mkdir -p $OUT
timeout 150 python3 -m pytest -q -p no:cacheprovider packages/sparse-kernels/tests/test_compact.py packages/sparse-kernels/tests/test_linear.py packages/sparse-kernels/tests/test_decode_buffers.py tests/test_eviction_round.py tests/test_eviction_pipeline.py -k "gpu or cuda or CUDA or linear or compact or split" > $OUT/gpu_tests.txt 2>&1; tail -3 $OUT/gpu_tests.txt
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048)
S=(--sink-keep-tokens 64 --decode-keep-tokens 7616 --recent-keep-tokens 512)
timeout 90 "${B[@]}" --out $OUT/warm --sparse-method snapkv "${S[@]}" --decode-eviction-interval 256 --batch-size max --timed-steps 258 --max-num-seqs 192 > $OUT/warm_log.txt 2>&1
timeout 100 "${B[@]}" --out $OUT/ev --batch-size 5 --timed-steps 2040 --profile-steps 3 --max-num-seqs 8 > $OUT/ev_log.txt 2>&1
timeout 150 "${B[@]}" --out $OUT/ev --append --sparse-method snapkv "${S[@]}" --decode-eviction-interval 256 --batch-size max,5 --timed-steps 2040 --profile-steps 3 --max-num-seqs 192 >> $OUT/ev_log.txt 2>&1
timeout 60 "${B[@]}" --out $OUT/ev --append --sparse-method snapkv "${S[@]}" --batch-size 5 --timed-steps 2040 --profile-steps 3 --max-num-seqs 192 >> $OUT/ev_log.txt 2>&1
grep "^|" $OUT/ev/bench.md | head -8; grep "\*\*" $OUT/ev/bench.md
timeout 60 "${B[@]}" --out $OUT/qa --batch-size 5 --timed-steps 128 --profile-steps 3 --max-num-seqs 8 --sparse-method quest --sink-keep-tokens 64 --decode-keep-tokens 1472 --recent-keep-tokens 512 > $OUT/qa_log.txt 2>&1
grep "^| quest" $OUT/qa/bench.md
python3 - <<PY
import json, statistics
for f in ("$OUT/warm/bench.json", "$OUT/ev/bench.json", "$OUT/qa/bench.json"):
    try: d = json.load(open(f))
    except Exception as e: print(f, e); continue
    for inv in d["invocations"]:
        for r in inv["runs"]:
            raw = r["raw"]; s = raw["step_seconds"]; med = statistics.median(s)
            big = [(i, round(x * 1e3)) for i, x in enumerate(s) if x > 3 * med]
            print(f.split("/")[-2], r["sparse_method"], raw["batch_size"], "steps", len(s), "median", round(med * 1e3, 2), "wall/step", round(raw["wall_seconds"] / len(s) * 1e3, 2), "first256", round(sum(s[:256]) / 256 * 1e3, 2), "busy", raw.get("gpu_kernel_ms_per_step"), "big", big[:10])
            print("   top", [(k["name"][:24], round(k["ms_per_step"], 3)) for k in raw.get("gpu_kernels_top", [])][:8])
PY
