"""RetroInfer's per-step decode selection (``sparse_methods.cluster_selection``) against the implementation it
replaced (``cluster_selection_reference``): what each touches per layer, and how long each takes.

1. Bytes and elements at the issue-17 shape: Qwen3-8B attention (32 query heads, 8 KV heads, head_dim 128,
   bf16, 36 layers), batch 5, 128K context with 2K more planned (16-token blocks), RetroInfer's defaults
   (16-token clusters, 1.8% read, 23.2% estimated, sink 4, recent 64, update 1024), every row mid-way through
   an update block. Counted on the meta device op by op (a ``TorchDispatchMode``): each op's outputs are
   written, its inputs read (an expanded input only for its storage, a gather only for what it gathers),
   views are free. On meta the fast path counts the torch references of its kernels: ``cluster_logits``
   (gathered centroids, float32 einsum; on CUDA a Triton kernel reads the centroids in place, once per KV
   group) and ``cluster_picks`` (on CUDA two Triton kernels). ``cluster_estimation`` (the same call in both)
   and index writes are left out.
2. Both timed on real tensors at a reduced context on the CPU (``--device cuda`` for the GPU: any size,
   each path replayed in a CUDA graph), after checking that they give the same slots and estimated clusters.

    uv run python benchmarks/retroinfer_select_cost.py [--batch 5] [--context 131072] \\
        [--time-context 32768] [--device cpu|cuda] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import sparse_methods as sm
from sparse_kernels.cluster_attention import cluster_counts
from sparse_methods import ClusterArena
from sparse_methods.base import DecodeBatch
from sparse_methods.cluster_selection import (
    cluster_columns,
    ordered_clusters,
    pick_clusters,
    rank_arena_clusters,
    selection_widths,
)
from sparse_methods.cluster_selection_reference import (
    cluster_slots_reference,
    estimated_cluster_ids_reference,
    rank_arena_clusters_reference,
)

SHAPE = sm.ModelShape(num_layers=36, num_q_heads=32, num_kv_heads=8, head_dim=128)
BLOCK, PLANNED_OUTPUT = 16, 2048
VIEWS = {"view", "_unsafe_view", "expand", "permute", "transpose", "t", "slice", "select", "unsqueeze", "squeeze"}
VIEWS |= {"alias", "as_strided", "detach", "lift_fresh", "_reshape_alias", "view_as"}
GATHERS = {"index", "gather", "index_select"}


class OpCounter(TorchDispatchMode):
    """Per op run under it: ``(name, bytes read, bytes written, elements written, largest output shape)``."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, int, int, int, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in VIEWS:
            return out
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        written = sum(t.numel() * t.element_size() for t in outs)
        read = sum(min(t.numel() * t.element_size(), t.untyped_storage().nbytes()) for t in ins)
        if name in GATHERS:  # the source is read where gathered only
            read += written - min(ins[0].numel() * ins[0].element_size(), ins[0].untyped_storage().nbytes())
        largest = max(outs, key=lambda t: t.numel() * t.element_size(), default=None)
        self.ops.append((name, read, written, sum(t.numel() for t in outs), tuple(largest.shape) if outs else ()))
        return out


def setup(batch: int, context: int, device: str, seed: int = 0):
    """``(arena, decode batch, sink, width, widths, avg)``: ``batch`` rows of a ``context``-token decode, each
    with its own index in the arena (random clusters, as unequal as k-means leaves them; no data on meta)."""
    method = sm.build_method("retroinfer", SHAPE)
    c = method.config
    sink, avg, ratio = c.retroinfer_sink_tokens, c.retroinfer_avg_cluster_size, c.retroinfer_estimation_ratio
    plan = method.memory_plan(context, PLANNED_OUTPUT, 8192)
    heads, dim = SHAPE.num_kv_heads, SHAPE.head_dim
    tokens, clusters = max(plan.peak_tokens), plan.index_clusters
    arena = ClusterArena(1, batch, tokens, clusters, heads, dim, torch.bfloat16, device, plan_rows=batch)
    end = context - c.retroinfer_recent_tokens - c.retroinfer_update_tokens // 2
    count, width = (end - sink) // avg, method.selection_size(context, BLOCK)
    budget = width - sink - (context - end)
    retrieved, estimated = cluster_counts(count, c.retroinfer_retrieval_ratio, ratio)
    retrieved = ordered_clusters(retrieved, budget, avg, count)
    if device != "meta":  # on meta only the shapes count
        for r in range(batch):
            _fill_row(arena, r, count, end, sink, torch.Generator().manual_seed(seed + r))
        rows = [(r * tokens, r * clusters, count, end, budget, retrieved, estimated) for r in range(batch)]
        arena.plan_rows(rows)
    gen = torch.Generator().manual_seed(seed)
    query = torch.randint(-3, 4, (batch, SHAPE.num_q_heads, dim), generator=gen).to(device, torch.bfloat16)
    kv = torch.full((batch,), context, dtype=torch.int64, device=device)
    max_pages = -(-(context + PLANNED_OUTPUT) // BLOCK)
    decode = DecodeBatch(query, kv, kv[:0], kv, max_pages, BLOCK, sm_scale=dim**-0.5)
    widths = selection_widths(cluster_columns(decode, avg), c.retroinfer_retrieval_ratio, ratio, width - sink, avg)
    return arena, decode, sink, width, widths, avg


def _fill_row(arena: ClusterArena, row: int, count: int, end: int, sink: int, gen: torch.Generator) -> None:
    """Row ``row``'s index: each token of ``[sink, end)`` in a random cluster, grouped by cluster (ascending
    within one, as ``build_cluster_index`` stores them); centroids (and queries) of small integers, whose dot
    products are exact in any summation order, so the CUDA ranking must equal the reference's bit for bit."""
    centroids, sizes, offsets, positions, _ = arena.layers[0]
    heads, tokens = centroids.shape[0], end - sink
    assign = torch.randint(0, count, (heads, tokens), generator=gen)
    size = torch.zeros(heads, count, dtype=torch.int64).scatter_add_(1, assign, torch.ones_like(assign))
    t0, c0 = row * arena.tokens, row * arena.clusters
    device = centroids.device
    centroids[:, c0 : c0 + count] = torch.randint(-3, 4, (heads, count, centroids.shape[2]), generator=gen).to(device)
    sizes[:, c0 : c0 + count] = size.to(device)
    offsets[:, c0 : c0 + count] = (size.cumsum(1) - size).to(device)
    positions[:, t0 : t0 + tokens] = (torch.sort(assign, dim=1, stable=True).indices + sink).to(device)


def rank_fast(arena, batch, sink, width, widths, avg):
    return rank_arena_clusters(arena, 0, batch, avg, SHAPE.head_dim, widths=widths)


def select_fast(ranking, arena, batch, sink, width, widths, avg):
    return pick_clusters(arena, 0, batch, ranking, sink=sink, width=width, widths=widths)


def rank_reference(arena, batch, sink, width, widths, avg):
    return rank_arena_clusters_reference(arena, 0, batch, avg, SHAPE.head_dim, widths=widths)


def select_reference(ranking, arena, batch, sink, width, widths, avg):
    slots = cluster_slots_reference(arena, 0, batch, ranking, sink=sink, width=width)
    return slots, estimated_cluster_ids_reference(arena, batch, ranking, sum(widths))


PATHS = {"reference": (rank_reference, select_reference), "fast": (rank_fast, select_fast)}
"""Each path in two stages: the ranking, then the slots and the estimated clusters from it."""


def count(batch: int, context: int) -> dict:
    """Per path and stage (``rank``, ``select``): ops, MB read and written, M elements written, the largest."""
    case = setup(batch, context, "meta")
    result = {}
    for name, (rank, select) in PATHS.items():
        with OpCounter() as ranking_ops:
            ranking = rank(*case)
        with OpCounter() as selection_ops:
            select(ranking, *case)
        for stage, ops in (("rank", ranking_ops.ops), ("select", selection_ops.ops)):
            biggest = sorted(ops, key=lambda op: -op[2])[:3]
            result[f"{name} {stage}"] = {
                "ops": len(ops),
                "read_mb": sum(op[1] for op in ops) / 1e6,
                "written_mb": sum(op[2] for op in ops) / 1e6,
                "elements_m": sum(op[3] for op in ops) / 1e6,
                "largest": [f"{op[0]} {list(op[4])} {op[2] / 1e6:.1f} MB" for op in biggest],
            }
    return result


def timed(batch: int, context: int, device: str) -> dict:
    """ms per layer of each path's stages (CPU: median of 5 calls; CUDA: a CUDA graph's replay), after
    checking that both paths give the same slots and estimated clusters."""
    case = setup(batch, context, device)
    rankings = {name: rank(*case) for name, (rank, _) in PATHS.items()}
    ref, fast = (select(rankings[name], *case) for name, (_, select) in PATHS.items())
    slots_equal = torch.equal(fast[0].sort(-1).values, ref[0])  # the fast path's slots come in rank order
    result = {"equal": slots_equal and torch.equal(fast[1], ref[1])}
    for name, (rank, select) in PATHS.items():
        result[f"{name} rank"] = _ms(lambda rank=rank: rank(*case), device)
        result[f"{name} select"] = _ms(lambda name=name, select=select: select(rankings[name], *case), device)
    return result


def _ms(fn, device: str) -> float:
    if device == "cuda":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages/sparse-kernels/benchmarks"))
        from _timing import capture, median_ms

        return median_ms(capture(fn).replay)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=5)
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--time-context", type=int, default=32768)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    counts = count(args.batch, args.context)
    layers = SHAPE.num_layers
    print(f"per layer, batch {args.batch}, context {args.context} (x{layers} layers per step in the last columns)")
    print("| path, stage | ops | MB read | MB written | M elements | GB per step | ms per step at 4 TB/s |")
    print("|---|---|---|---|---|---|---|")
    for name, c in counts.items():
        total = (c["read_mb"] + c["written_mb"]) * layers / 1e3
        row = f"| {name} | {c['ops']} | {c['read_mb']:.1f} | {c['written_mb']:.1f} | {c['elements_m']:.1f}"
        print(f"{row} | {total:.2f} | {total / 4:.2f} |")
    for name, c in counts.items():
        print(f"{name} largest outputs: " + "; ".join(c["largest"]))
    times = timed(args.batch, args.time_context, args.device)
    print(f"\n{args.device}, batch {args.batch}, context {args.time_context}, ms per layer")
    print("| path | rank | slots + estimated ids | total |\n|---|---|---|---|")
    for name in PATHS:
        rank, select = times[f"{name} rank"], times[f"{name} select"]
        print(f"| {name} | {rank:.2f} | {select:.2f} | {rank + select:.2f} |")
    print(f"same slots and estimated clusters: {times['equal']}")
    if args.json:
        settings = {"batch": args.batch, "context": args.context, "time_context": args.time_context}
        args.json.write_text(json.dumps({"settings": settings, "counts": counts, "times_ms": times}, indent=2))


if __name__ == "__main__":
    main()
