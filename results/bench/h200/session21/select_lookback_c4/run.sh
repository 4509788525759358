#!/usr/bin/env bash
# Session 21 call 4: the selection's write pass with a decoupled look-back (no re-read of earlier chunks): native
# GPU tests of the selection, the kernel probe at its defaults, dense 256 steps then RetroInfer 1100 steps (one
# index update) at 128K x 5.
set -x
OUT=$1; C=$2
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
timeout 100 python3 -m pytest -q -p no:cacheprovider packages/sparse-kernels/tests/test_cluster_select.py \
  packages/sparse-methods/tests/test_cluster_selection.py --deselect packages/sparse-kernels/tests/test_cluster_select.py::test_triton_equals_reference \
  --deselect packages/sparse-methods/tests/test_cluster_selection.py::test_triton_picks_equal_the_full_sort_reference \
  tests/test_retroinfer_engine.py::test_decode_replays_cuda_graphs_and_equals_eager > $OUT/gpu_tests.txt 2>&1
tail -3 $OUT/gpu_tests.txt
timeout 60 python3 -u benchmarks/retroinfer_kernel_probe.py --batch 5 --context 131072 --sweep none > $OUT/probe.txt 2>&1
grep "^|" $OUT/probe.txt
B=(bench --no-progress --prompt-len 131072 --output-len 2048 --batch-size 5)
E=(--commit "$C" --profile-steps 3 --out $OUT/engine)
timeout 70 python3 -m sparse_serve.cli "${B[@]}" "${E[@]}" --timed-steps 256 --max-num-seqs 64 > $OUT/dense.txt 2>&1
timeout 130 python3 -m sparse_serve.cli "${B[@]}" "${E[@]}" --append --sparse-method retroinfer --timed-steps 1100 --max-num-seqs 8 > $OUT/retro.txt 2>&1
tail -2 $OUT/retro.txt
python3 - <<PY
import json
d = json.load(open("$OUT/engine/bench.json"))
for inv in d["invocations"]:
    for r in inv["runs"]:
        raw, m = r["raw"], r["metrics"]
        st = raw["step_seconds"]; med = sorted(st)[len(st)//2]
        e = raw["step_end_unix"]; g = [e[i]-e[i-1] for i in range(1, len(e))]; gm = sorted(g)[len(g)//2]
        print(r["sparse_method"], "ms/step", round(m["ms_per_step"], 3), "median host", round(med*1e3, 2), "median gap", round(gm*1e3, 2), "tok/s", round(m["tokens_per_s"], 1), "busy", raw.get("gpu_kernel_ms_per_step"), "GB", round(m["bytes_per_step"] / 1e9, 2), "copy", round(m.get("fraction_of_copy_bw", 0), 3), "long gaps", [(i, round(x*1e3)) for i, x in enumerate(g) if x > 1.5*gm], "stalls", raw.get("stalls"))
        for k in raw.get("gpu_kernels_top", [])[:14]:
            print("   ", k["name"][:50], round(k["ms_per_step"], 4), k.get("calls_per_step"))
PY
(cd $OUT && tar czf engine.tgz engine && rm -rf engine)
