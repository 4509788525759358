"""Block-sparse prefill (flashprefill_v2) against the dense Triton prefill on the GPU, one layer.

Qwen3-8B-shaped layer (32 query heads, 8 KV heads, head_dim 128, bf16, 16-token pages in a shuffled
pool), random Q/K/V. For each context length: a chunk of ``--chunk`` queries at the end of the context
(cached prefix) and one chunk of the whole prompt. Times the dense prefill kernel and the block-sparse
run (block means + selection + kernel, and each part alone) at each threshold, with the fraction of
causally visible key blocks kept (and mean-corrected); threshold 0 is also checked against dense.
Random keys have no structure, so the kept fraction here is an upper bound; ``--q-scale`` sharpens the
scores. Optional sweep of the block-sparse kernel's tile config. Writes JSON to the path given.

    python benchmarks/flashprefill_probe.py OUT.json [--contexts 32768,131072] [--chunk 2048]
        [--thresholds 0,0.002,0.01,0.05,0.1] [--q-scale 1] [--configs n64w8s2,n64w4s3,n128w8s2]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from prefill_kernel_probe import cuda_time  # the same timing as the dense probe (this script's folder)

from sparse_kernels import BatchPrefillWithPagedKVCache
from sparse_kernels._triton import block_sparse_prefill as kernel
from sparse_kernels.block_sparse_prefill import BatchBlockSparsePrefillWithPagedKVCache
from sparse_kernels.prefill_block_selection import BlockSparseParams, select_blocks

HQ, HKV, D, BS = 32, 8, 128, 16


def parse_config(name: str) -> dict:
    """``n64w8s2`` -> BLOCK_N 64, num_warps 8, num_stages 2."""
    n, rest = name[1:].split("w")
    w, s = rest.split("s")
    return {"BLOCK_N": int(n), "num_warps": int(w), "num_stages": int(s)}


def pool(ctx: int, dev) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    num_blocks = ctx // BS
    k = torch.randn(num_blocks + 8, BS, HKV, D, dtype=torch.bfloat16, device=dev)
    v = torch.randn_like(k)
    table = torch.randperm(num_blocks + 8)[:num_blocks].to(torch.int32)
    return k, v, table


def plan_args(q_len: int, ctx: int, table: torch.Tensor) -> tuple:
    qo_indptr = torch.tensor([0, q_len], dtype=torch.int32)
    kv_indptr = torch.tensor([0, table.numel()], dtype=torch.int32)
    last = torch.tensor([ctx - (table.numel() - 1) * BS], dtype=torch.int32)
    return qo_indptr, kv_indptr, table, last


def probe(ctx: int, q_len: int, thresholds, q_scale: float, configs, dev) -> list[dict]:
    k_cache, v_cache, table = pool(ctx, dev)
    q = (torch.randn(q_len, HQ, D, device=dev) * q_scale).to(torch.bfloat16)
    shape = dict(num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, block_size=BS)
    args = plan_args(q_len, ctx, table)
    dense = BatchPrefillWithPagedKVCache(dev)
    dense.plan(*args, **shape)
    dense_out = dense.run(q, k_cache, v_cache)
    base = dict(context=ctx, q_len=q_len, q_scale=q_scale, dense_s=cuda_time(lambda: dense.run(q, k_cache, v_cache)))
    rows, visible = [], None
    for threshold in thresholds:  # threshold 0 first: its kept blocks are every causally visible one
        sparse = BatchBlockSparsePrefillWithPagedKVCache(dev, params=BlockSparseParams(threshold, min_sparse_q_len=0))
        t0 = time.perf_counter()
        sparse.plan(*args, **shape)
        row = dict(base, threshold=threshold, plan_host_s=time.perf_counter() - t0)
        row.update(time_sparse(sparse, q, k_cache, v_cache, configs))
        kept = row.pop("kept_blocks")
        visible = visible or kept
        row["kept_frac"] = kept / visible
        row["mean_frac"] = row.pop("mean_blocks") / visible
        row["speedup_vs_dense"] = row["dense_s"] / row["total_s"]
        if threshold == 0:
            diff = sparse.run(q, k_cache, v_cache).float() - dense_out.float()
            row["max_abs_diff_vs_dense"] = float(diff.abs().max())
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def time_sparse(sparse, q, k_cache, v_cache, configs) -> dict:
    """Seconds of the block means, the selection, the kernel (per tile config) and the whole run."""
    k_mean, v_mean, lists = sparse.select(q, k_cache, v_cache)
    layout, plan = sparse.layout, sparse._plan
    out = torch.empty_like(q)
    row = dict(
        kept_blocks=int(lists.keep_counts.sum()),
        mean_blocks=int(lists.mean_counts.sum()),
        means_s=cuda_time(lambda: kernel.block_means_triton(k_cache, v_cache, layout.slots)),
        select_s=cuda_time(lambda: select_blocks(q, k_mean, layout, plan.sm_scale)),
        kernel_s={},
    )
    default = dict(kernel.BLOCK_SPARSE_PREFILL_CONFIG)
    for name in configs:
        kernel.BLOCK_SPARSE_PREFILL_CONFIG.update(parse_config(name))
        row["kernel_s"][name] = cuda_time(
            lambda: kernel.run_block_sparse_prefill_triton(
                plan, layout, lists, q, k_cache, v_cache, k_mean, v_mean, out
            )
        )
    kernel.BLOCK_SPARSE_PREFILL_CONFIG.update(default)
    row["total_s"] = cuda_time(lambda: sparse.run(q, k_cache, v_cache))
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--thresholds", default="0,0.002,0.01,0.05,0.1")
    ap.add_argument("--q-scale", type=float, default=1.0)
    ap.add_argument("--configs", default="n64w8s2,n64w4s3,n128w8s2,n32w4s2")
    ap.add_argument("--no-long-chunk", action="store_true", help="skip the whole-prompt chunk")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    thresholds = sorted(float(t) for t in args.thresholds.split(","))
    if thresholds[0] != 0:
        thresholds.insert(0, 0.0)
    configs = args.configs.split(",")
    rows = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        for q_len in [args.chunk] + ([] if args.no_long_chunk else [ctx]):
            rows += probe(ctx, q_len, thresholds, args.q_scale, configs, dev)
            torch.cuda.empty_cache()
    meta = dict(device=torch.cuda.get_device_name(), heads=[HQ, HKV, D], block_size=BS, dtype="bfloat16")
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
