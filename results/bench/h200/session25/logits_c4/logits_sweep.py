"""Session 25: cluster_logits launch shapes at RetroInfer's decode shape (Qwen3-8B heads, 128K, batch 5; one layer,
36 calls in a CUDA graph, as benchmarks/retroinfer_kernel_probe.py), one-warp programs included; writes the best
to best.json for logitswrap.py."""
import json
import sys

import torch

sys.path.insert(0, "benchmarks")
from retroinfer_kernel_probe import graph_ms  # noqa: E402

from sparse_kernels._triton import cluster_logits as m  # noqa: E402
from sparse_kernels.cluster_logits import cluster_logits  # noqa: E402

out = sys.argv[1]
dev = torch.device("cuda")
gen = torch.Generator(device=dev).manual_seed(0)
n, heads, group, dim, avg, context = 5, 8, 4, 128, 16, 131072
columns = (context + 2048) // avg
total = n * columns
query = torch.randn(n, heads * group, dim, device=dev, generator=gen, dtype=torch.bfloat16)
centroids = torch.randn(heads, total, dim, device=dev, generator=gen).to(torch.bfloat16)
sizes = torch.randint(1, 2 * avg, (heads, total), device=dev, generator=gen, dtype=torch.int32)
bases = torch.arange(n, device=dev) * columns
counts = torch.full((n,), context // avg, device=dev)
ref = cluster_logits(query, centroids, sizes, bases, counts, columns, scale=dim**-0.5)
default = (m.BLOCK_C, m.NUM_WARPS, m.TILES_PER_PROGRAM, m.NUM_STAGES)
shapes = [default] + [
    (bc, 1, t, st) for bc in (32, 64, 128) for t in (1, 2, 4) for st in (2, 3)
] + [(64, 2, t, 3) for t in (1, 2, 4)] + [(128, 4, 4, 2), (128, 4, 2, 3)]
rows = []
for bc, w, t, st in shapes:
    m.BLOCK_C, m.NUM_WARPS, m.TILES_PER_PROGRAM, m.NUM_STAGES = bc, w, t, st
    try:
        got = cluster_logits(query, centroids, sizes, bases, counts, columns, scale=dim**-0.5)
        err = max(float((got.logits - ref.logits).abs().max()), float((got.tile_max.amax() - ref.tile_max.amax()).abs()))
        ok = torch.equal(got.sizes, ref.sizes) and err < 1e-3
        ms = graph_ms(lambda: cluster_logits(query, centroids, sizes, bases, counts, columns, scale=dim**-0.5))
    except Exception as e:  # noqa: BLE001
        print(bc, w, t, st, "failed", repr(e)[:200], flush=True)
        continue
    bytes_ = n * heads * columns * (dim * 2 + 4 + group * 4 + 4)
    rows.append(dict(BLOCK_C=bc, NUM_WARPS=w, TILES_PER_PROGRAM=t, NUM_STAGES=st, us=ms * 1e3, ok=ok, err=err,
                     tbps=bytes_ / (ms * 1e-3) / 1e12))
    print(rows[-1], flush=True)
good = [r for r in rows if r["ok"]]
best = min(good, key=lambda r: r["us"])
json.dump(dict(rows=rows, best=best, default=rows[0]), open(f"{out}/logits_sweep.json", "w"), indent=1)
json.dump({k: best[k] for k in ("BLOCK_C", "NUM_WARPS", "TILES_PER_PROGRAM", "NUM_STAGES")}, open(f"{out}/best.json", "w"))
print("default", rows[0]["us"], "best", best, flush=True)
