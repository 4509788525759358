#!/usr/bin/env bash
# Session 10 call 2: decode split target x floor on tokens per split at the engine's shapes; host profile of an
# eviction round at b91; engine steps with a candidate setting.
set -x
OUT=$1; C=$2
mkdir -p $OUT
export PYTHONPATH=$PYTHONPATH:packages/sparse-kernels/benchmarks
D=packages/sparse-kernels/benchmarks/decode_bandwidth.py
timeout 80 python3 $D --kv-len 8448 --cases 91x1 --per-sm 8,16,32,48 --min-split 0,512,768 --json $OUT/s_8448.json > $OUT/s_8448.txt 2>&1
timeout 90 python3 $D --kv-len 10240 --cases 76x1,5x16 --per-sm 8,32 --min-split 0,512,768,1024 --json $OUT/s_10240.json > $OUT/s_10240.txt 2>&1
timeout 60 python3 $D --kv-len 2048 --cases 5x64 --per-sm 8,32 --min-split 0,256,512,768 --json $OUT/s_2048.json > $OUT/s_2048.txt 2>&1
timeout 60 python3 $D --kv-len 131072 --cases 5x2 --per-sm 8,32 --min-split 0,768 --json $OUT/s_131072.json > $OUT/s_131072.txt 2>&1
timeout 60 python3 $D --kv-len 32768 --cases 1x8 --per-sm 8,32 --min-split 0,768 --json $OUT/s_32768.json > $OUT/s_32768.txt 2>&1
for f in 8448 10240 2048 131072 32768; do grep -v "^{" $OUT/s_$f.txt | grep -v "^$"; done
cat > $OUT/prof.py <<'PY'
import cProfile, pstats, sys, time
from sparse_serve import engine as E
orig = E.LLMEngine.step
slow = []
def step(self, *a, **k):
    pr = cProfile.Profile(); t = time.perf_counter(); pr.enable()
    try:
        return orig(self, *a, **k)
    finally:
        pr.disable(); dt = time.perf_counter() - t
        if dt > 0.1:
            slow.append((dt, pr))
E.LLMEngine.step = step
from sparse_serve.cli import main
main(sys.argv[1:])
print("slow steps (s):", [round(d, 3) for d, _ in slow])
for d, pr in slow[-2:]:
    print("=== step", round(d, 3))
    pstats.Stats(pr).sort_stats("tottime").print_stats(30)
PY
B=(bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --sparse-method snapkv --sink-keep-tokens 64 --decode-keep-tokens 7616 --recent-keep-tokens 512 --max-num-seqs 192)
timeout 150 python3 $OUT/prof.py "${B[@]}" --decode-eviction-interval 256 --batch-size max --timed-steps 530 --out $OUT/prof > $OUT/prof.txt 2>&1
grep -A45 "slow steps" $OUT/prof.txt | cut -c1-160 | head -90
for CFG in "32 768"; do set -- $CFG
timeout 150 python3 -c "
import sparse_kernels._decode_buffers as b; b.PROGRAMS_PER_SM=$1; b.MIN_SPLIT_TOKENS=$2
from sparse_serve.cli import main
import sys
a=sys.argv[1:]
main(a+['--out','$OUT/eng','--decode-eviction-interval','256','--batch-size','max','--timed-steps','120','--profile-steps','3'])
main(a+['--out','$OUT/eng','--append','--batch-size','5','--timed-steps','120','--profile-steps','3'])
main(a[:a.index('--sparse-method')]+['--max-num-seqs','8','--out','$OUT/eng','--append','--sparse-method','quest','--sink-keep-tokens','64','--decode-keep-tokens','1472','--recent-keep-tokens','512','--batch-size','5','--timed-steps','120','--profile-steps','3'])
" "${B[@]}" > $OUT/eng_$1_$2.txt 2>&1; tail -3 $OUT/eng_$1_$2.txt
done
python3 - <<PY
import json, statistics
d = json.load(open("$OUT/eng/bench.json"))
for inv in d["invocations"]:
    for r in inv["runs"]:
        raw = r["raw"]; s = raw["step_seconds"]
        print(r["sparse_method"], raw["batch_size"], "median", round(statistics.median(s) * 1e3, 2), "busy", raw.get("gpu_kernel_ms_per_step"))
        print("   top", [(k["name"][:24], round(k["ms_per_step"], 3)) for k in raw.get("gpu_kernels_top", [])][:6])
PY
