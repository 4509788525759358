"""Session 29 call 6: RetroInfer's cluster selection alone at batch 5 / 128K (5 rows x 8 KV heads x 4 query heads,
8208 columns, 425 retrieved, 1904 estimated): the package's kernel (one first-round histogram for both targets)
against the one before (BEFORE_MODULE_PATH: `git show d5bcafe:packages/sparse-kernels/src/sparse_kernels/_triton/
cluster_select.py`). 36 calls (a step's layers) captured in a CUDA graph, replayed; outputs compared.
Usage: python3 select_probe.py BEFORE_MODULE_PATH OUT_JSON"""

import importlib.util
import json
import sys

import torch

from sparse_kernels._triton import cluster_select as new
from sparse_kernels.cluster_logits import softmax_statistics

spec = importlib.util.spec_from_file_location("before_cluster_select", sys.argv[1])
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)

n, H, G, C, R, E = 5, 8, 4, 8208, 425, 1904
gen = torch.Generator(device="cuda").manual_seed(0)
sizes = torch.randint(0, 33, (n, H, C), device="cuda", dtype=torch.int32, generator=gen)
logits = torch.randn(n, H, G, C, device="cuda", generator=gen) * 3
logits.masked_fill_((sizes == 0)[:, :, None, :], float("-inf"))
tmax, tsum = softmax_statistics(logits)
ret, est = torch.full((n,), R, device="cuda"), torch.full((n,), E, device="cuda")


def timed(fn, layers=36, reps=20):
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fn() for _ in range(layers)]
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (reps * layers), outs[-1]


results = {}
for name, module in (("before", old), ("one first-round histogram", new), ("before again", old)):
    t, got = timed(lambda m=module: m.cluster_select_triton(logits, sizes, tmax, tsum, ret, est, R, E))
    results[name] = t
    if name == "before":
        want = got
    results[name + " equal"] = bool(torch.equal(got, want))
    print(f"{name}: {t:.2f} us a call, equal: {results[name + ' equal']}", flush=True)
json.dump(results, open(sys.argv[2], "w"), indent=1)
