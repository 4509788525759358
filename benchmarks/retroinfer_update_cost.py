"""What one RetroInfer index update costs per layer: ``build_cluster_index`` over one layer's due blocks (every
request's ``retroinfer_update_tokens`` new tokens, the requests' KV heads stacked, as ``RetroInfer._index_blocks``
calls it), counted and timed three ways.

1. Ops: the top-level torch ops one call dispatches (CPU profiler; each is a launch on CUDA). Session 21 found the
   engine's update step host-bound: ~200 ops a layer, ~7,200 for 36 layers, 157-209 ms at batch 4-5 on the H200.
2. Eager: wall time per call on ``--device`` (CUDA: synchronized around ``--reps`` calls), the engine's way.
3. Graphed (CUDA only): through the engine's ``GraphedIndexBuilder`` (captured once, then each call copies its
   inputs into the graph's buffers and replays it); the replay's index on fresh inputs is checked against the
   eager call's (centroids, sizes, positions). An update shape (stacked heads, block length) repeats every
   update, so one graph per shape serves every layer.

    uv run python benchmarks/retroinfer_update_cost.py [--requests 5] [--kv-heads 8] [--tokens 1024] \\
        [--device cpu|cuda] [--reps 36]
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import torch

from sparse_kernels.cluster_index import build_cluster_index


def count_ops(keys: torch.Tensor, values: torch.Tensor, avg: int) -> Counter:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        build_cluster_index(keys, values, start=0, avg_cluster_size=avg, segments=1)
    return Counter(e.name for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)


def eager_ms(keys: torch.Tensor, values: torch.Tensor, avg: int, reps: int) -> float:
    def sync():
        if keys.is_cuda:
            torch.cuda.synchronize()

    build_cluster_index(keys, values, start=0, avg_cluster_size=avg, segments=1)
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        build_cluster_index(keys, values, start=0, avg_cluster_size=avg, segments=1)
    sync()
    return (time.perf_counter() - t0) * 1e3 / reps


def graphed_ms(keys: torch.Tensor, values: torch.Tensor, avg: int, reps: int) -> tuple[float, bool]:
    """ms per call of the engine's ``GraphedIndexBuilder`` once its graph is captured (each call copies the
    inputs into the graph's buffers and replays it), and whether a replay on fresh inputs equals an eager call."""
    from sparse_kernels.cluster_index_graphs import GraphedIndexBuilder

    builder = GraphedIndexBuilder(max_token_heads=keys.shape[0] * keys.shape[1])
    builder(keys, values, avg_cluster_size=avg, segments=1)  # captures
    fresh_k, fresh_v = torch.randn_like(keys), torch.randn_like(values)
    out = builder(fresh_k, fresh_v, avg_cluster_size=avg, segments=1)
    want = build_cluster_index(fresh_k, fresh_v, start=0, avg_cluster_size=avg, segments=1)
    same = (
        torch.equal(out.sizes, want.sizes)
        and torch.equal(out.sorted_positions, want.sorted_positions)
        and torch.allclose(out.centroids.float(), want.centroids.float(), atol=1e-2)
    )
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        builder(keys, values, avg_cluster_size=avg, segments=1)
    torch.cuda.synchronize()
    assert builder.captures == 1
    return (time.perf_counter() - t0) * 1e3 / reps, same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=5, help="requests whose blocks are due in the same step")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=1024, help="retroinfer_update_tokens")
    ap.add_argument("--avg-cluster-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=36, help="layers an update step indexes (for the totals)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=36)
    args = ap.parse_args()
    device = torch.device(args.device)
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (args.tokens, args.requests * args.kv_heads, args.head_dim)
    keys = torch.randn(shape, generator=gen, device=device).to(torch.bfloat16)
    values = torch.randn(shape, generator=gen, device=device).to(torch.bfloat16)
    ops = count_ops(keys.cpu(), values.cpu(), args.avg_cluster_size)
    total = sum(ops.values())
    print(f"{shape[1]} stacked KV heads x {args.tokens} tokens: {total} top-level torch ops a layer, "
          f"{total * args.layers} for {args.layers} layers")  # fmt: skip
    print("  most frequent:", ", ".join(f"{name[6:]} {n}" for name, n in ops.most_common(8)))
    ms = eager_ms(keys, values, args.avg_cluster_size, args.reps)
    print(f"eager on {device.type}: {ms:.3f} ms a layer, {ms * args.layers:.1f} ms an update step")
    if device.type == "cuda":
        ms, same = graphed_ms(keys, values, args.avg_cluster_size, args.reps)
        print(f"graphed: {ms:.3f} ms a layer, {ms * args.layers:.1f} ms an update step (equals eager: {same})")


if __name__ == "__main__":
    main()
