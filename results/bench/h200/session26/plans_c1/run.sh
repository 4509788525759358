#!/usr/bin/env bash
# Session 26 call 1: is the 128K prefill's slowdown after HF cold cuDNN plans? Plan-build cost per prefix shape;
# HF (cold, warm) then the engine (cold, warm) at 128K in one process.
OUT=$1; C=$2
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
timeout 120 python3 - > $OUT/plans.txt 2>&1 <<'PY'
import time, torch
from sparse_kernels.prefix_attention import attention_with_lse
q = torch.randn(2048, 32, 128, device="cuda", dtype=torch.bfloat16)
for n in [4096, 8192, 12288, 16384, 65536, 126976]:
    k = torch.randn(n, 8, 128, device="cuda", dtype=torch.bfloat16); v = torch.randn_like(k)
    ts = []
    for r in range(3):
        torch.cuda.synchronize(); t = time.perf_counter(); attention_with_lse(q, k, v, 0.088); torch.cuda.synchronize()
        ts.append(1e3 * (time.perf_counter() - t))
    print(n, " ".join(f"{x:.1f}ms" for x in ts), flush=True)
PY
cat $OUT/plans.txt
timeout 420 python3 -m sparse_serve.cli bench --no-progress --commit "$C" --out $OUT/pf --prefill real \
  --prompt-len 131072,131072 --batch-size 1 --output-len 4 --warmup-steps 1 --max-num-seqs 8 --hf-baseline --hf-steps 2 \
  > $OUT/pf.txt 2>&1
grep -iE "prefill|hf|131072" $OUT/pf/bench.md | head -20; tail -3 $OUT/pf.txt
(cd $OUT && tar czf pf.tgz pf pf.txt && rm -rf pf pf.txt)
