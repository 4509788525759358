"""Session 29: RetroInfer's cluster selection alone at batch 5 / 128K (5 rows x 8 KV heads x 4 query heads, 8208
columns, 425 retrieved, 1904 estimated): the one-program kernel at several warp counts against the three-launch
radix select it replaced (old_cluster_select.py, from 1bc70f8~1). 36 calls (a step's layers) captured in a CUDA
graph, replayed; outputs compared. Usage: python3 select_probe.py OLD_MODULE_PATH OUT_JSON"""

import importlib.util
import json
import sys

import torch

from sparse_kernels._triton import cluster_select as new
from sparse_kernels.cluster_logits import softmax_statistics

spec = importlib.util.spec_from_file_location("old_cluster_select", sys.argv[1])
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
t_old, want = timed(lambda: old.cluster_select_triton(logits, sizes, tmax, tsum, ret, est, R, E))
results["old three launches"] = t_old
print(f"old: {t_old:.2f} us a call", flush=True)
for warps in (4, 8, 16, 32):
    new.NUM_WARPS = warps
    try:
        t, got = timed(lambda: new.cluster_select_triton(logits, sizes, tmax, tsum, ret, est, R, E))
    except Exception as e:  # noqa: BLE001
        print(f"new {warps} warps failed: {e!r}"[:300], flush=True)
        continue
    same = bool(torch.equal(got, want))
    results[f"new {warps} warps"] = t
    results[f"new {warps} warps equal"] = same
    print(f"new, {warps} warps: {t:.2f} us a call, equal to old: {same}", flush=True)
json.dump(results, open(sys.argv[2], "w"), indent=1)
