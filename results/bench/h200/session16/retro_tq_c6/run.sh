set -x
OUT=$1; COMMIT=$2
mkdir -p $OUT
timeout 150 python3 benchmarks/retroinfer_kernel_probe.py --batch 5 --json $OUT/retro_probe.json > $OUT/retro_probe.txt 2>&1
grep -E "logits|estimation" $OUT/retro_probe.txt
A=(--no-progress --commit $COMMIT --prompt-len 131072 --output-len 2048 --out $OUT/engine)
python3 -m sparse_serve.cli bench "${A[@]}" --batch-size 5 --timed-steps 64 --max-num-seqs 8 > $OUT/dense.log 2>&1
python3 -m sparse_serve.cli bench "${A[@]}" --append --sparse-method retroinfer --batch-size 5 --timed-steps 64 --max-num-seqs 8 --profile-steps 3 > $OUT/retro.log 2>&1
PROBE_JSON=$OUT/retro_probe.json python3 retrowrap.py bench "${A[@]}" --append --sparse-method retroinfer --batch-size 5 --timed-steps 64 --max-num-seqs 8 --profile-steps 3 > $OUT/retro_pick.log 2>&1
grep settings $OUT/retro_pick.log
grep -E "^\| (dense|retro)" $OUT/engine/bench.md
python3 -m sparse_serve.cli bench "${A[@]}" --append --sparse-method turboquant --turboquant-bits 3 --batch-size 5,max --timed-steps 32 --max-num-seqs 64 > $OUT/tq3.log 2>&1
python3 -m sparse_serve.cli bench "${A[@]}" --append --sparse-method turboquant --turboquant-bits 4 --batch-size 5,max --timed-steps 32 --max-num-seqs 64 > $OUT/tq4.log 2>&1
grep -E "^\| (dense|retro|turbo)" $OUT/engine/bench.md
python3 - $OUT/engine/bench.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for inv in d["invocations"]:
    for r in inv["runs"]:
        top = r["raw"].get("gpu_kernels_top") or []
        print(r["sparse_method"], r["batch_size"], round(r["metrics"]["ms_per_step"], 2), [(k["name"][:40], round(k["ms_per_step"], 3)) for k in top[:12]])
PY
cd $OUT && tar -czf all.tgz *.txt *.json *.log engine && rm -rf engine *.log
