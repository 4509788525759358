"""Block-sparse prefill (flashprefill_v2) against the dense Triton prefill on the GPU, one layer.

Qwen3-8B-shaped layer (32 query heads, 8 KV heads, head_dim 128, bf16, 16-token pages in a shuffled
pool), random Q/K/V. For each context length: a chunk of ``--chunk`` queries at the end of the context
(cached prefix) and one chunk of the whole prompt. Times the dense prefill kernel and the block-sparse
run (block means + selection + kernel, and each part alone) at each threshold, with the fraction of
causally visible key blocks kept (and mean-corrected) and the output's error against dense (threshold 0
must match it). Random keys have no structure (attention is uniform: nothing is dropped), so
``--heavy-fracs F,..`` adds structure (one run per F; 0: plain random): per KV head a random fraction F
of the key blocks gets a shared direction that the head's queries share too (+``--heavy-logit`` on
those keys' logits), as retrieval heads concentrate on a few blocks; ``--q-scale`` sharpens all
scores. Optional sweep of the block-sparse kernel's tile config. Writes JSON to the path given.

    python benchmarks/flashprefill_probe.py OUT.json [--contexts 32768,131072] [--chunk 2048]
        [--thresholds 0,0.002,0.01,0.05,0.1] [--q-scale 1] [--heavy-fracs 0,0.1] [--heavy-logit 8]
        [--configs n64w4s3,n64w8s2,n128w8s2]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from prefill_kernel_probe import cuda_time  # the same timing as the dense probe (this script's folder)

from sparse_kernels import BatchPrefillWithPagedKVCache
from sparse_kernels._triton import block_sparse_prefill as kernel
from sparse_kernels._triton.prefill_block_selection import block_means_triton, select_blocks_triton
from sparse_kernels.block_sparse_prefill import BatchBlockSparsePrefillWithPagedKVCache
from sparse_kernels.prefill_block_selection import BlockSparseParams

HQ, HKV, D, BS = 32, 8, 128, 16


def parse_config(name: str) -> dict:
    """``n64w8s2`` -> BLOCK_N 64, num_warps 8, num_stages 2."""
    n, rest = name[1:].split("w")
    w, s = rest.split("s")
    return {"BLOCK_N": int(n), "num_warps": int(w), "num_stages": int(s)}


def pool(ctx: int, dev, heavy: torch.Tensor | None, lift: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shuffled pages of random K/V; the keys of each head's heavy 128-token blocks lifted along its direction."""
    num_blocks = ctx // BS
    k = torch.randn(num_blocks + 8, BS, HKV, D, device=dev)
    if heavy is not None:
        mask, u = heavy  # [HKV, ctx // 128] bool, [HKV, D] unit directions
        per_token = mask.repeat_interleave(128, 1)[:, :ctx].T.reshape(num_blocks, BS, HKV, 1)
        k[:num_blocks] += lift * per_token * u.view(1, 1, HKV, D)
    table = torch.randperm(num_blocks + 8)[:num_blocks].to(torch.int32)
    ordered = torch.zeros_like(k)
    ordered[table.long().to(dev)] = k[:num_blocks]  # logical page i lives at pool page table[i]
    v = torch.randn_like(k).to(torch.bfloat16)
    return ordered.to(torch.bfloat16), v, table


def structure(ctx: int, frac: float, logit: float, dev):
    """Heavy blocks (a random ``frac`` of each KV head's 128-token blocks) and the lift that gives a query
    along the head's direction ``logit`` more on their keys: lift^2 * D^-0.5 = logit."""
    if frac <= 0:
        return None, 0.0
    mask = torch.rand(HKV, -(-ctx // 128), device=dev) < frac
    u = torch.nn.functional.normalize(torch.randn(HKV, D, device=dev), dim=-1)
    return (mask, u), (logit * D**0.5) ** 0.5


def plan_args(q_len: int, ctx: int, table: torch.Tensor) -> tuple:
    qo_indptr = torch.tensor([0, q_len], dtype=torch.int32)
    kv_indptr = torch.tensor([0, table.numel()], dtype=torch.int32)
    last = torch.tensor([ctx - (table.numel() - 1) * BS], dtype=torch.int32)
    return qo_indptr, kv_indptr, table, last


def probe(ctx: int, q_len: int, thresholds, heavy_frac: float, args, configs, dev) -> list[dict]:
    heavy, lift = structure(ctx, heavy_frac, args.heavy_logit, dev)
    k_cache, v_cache, table = pool(ctx, dev, heavy, lift)
    q = torch.randn(q_len, HQ, D, device=dev) * args.q_scale
    if heavy is not None:
        q += lift * heavy[1].repeat_interleave(HQ // HKV, 0)
    q = q.to(torch.bfloat16)
    shape = dict(num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, block_size=BS)
    plan_in = plan_args(q_len, ctx, table)
    dense = BatchPrefillWithPagedKVCache(dev)
    dense.plan(*plan_in, **shape)
    dense_out = dense.run(q, k_cache, v_cache)
    base = dict(context=ctx, q_len=q_len, q_scale=args.q_scale, heavy_frac=heavy_frac, heavy_logit=args.heavy_logit)
    base["dense_s"] = cuda_time(lambda: dense.run(q, k_cache, v_cache))
    rows, visible = [], None
    for threshold in thresholds:  # threshold 0 first: its kept blocks are every causally visible one
        sparse = BatchBlockSparsePrefillWithPagedKVCache(dev, params=BlockSparseParams(threshold, min_sparse_q_len=0))
        sparse.plan(*plan_in, **shape)  # warm
        t0 = time.perf_counter()
        sparse.plan(*plan_in, **shape)
        row = dict(base, threshold=threshold, plan_host_s=time.perf_counter() - t0)
        row.update(time_sparse(sparse, q, k_cache, v_cache, configs))
        kept = row.pop("kept_blocks")
        visible = visible or kept
        row["kept_frac"] = kept / visible
        row["mean_frac"] = row.pop("mean_blocks") / visible
        row["speedup_vs_dense"] = row["dense_s"] / row["total_s"]
        diff = (sparse.run(q, k_cache, v_cache).float() - dense_out.float()).abs()
        row["max_abs_diff_vs_dense"], row["mean_abs_diff_vs_dense"] = float(diff.max()), float(diff.mean())
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
        means_s=cuda_time(lambda: block_means_triton(k_cache, v_cache, plan, layout)),
        select_s=cuda_time(lambda: select_blocks_triton(q, k_mean, plan, layout)),
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
    ap.add_argument("--heavy-fracs", default="0", help="structured keys: heavy block fractions per head (0: random)")
    ap.add_argument("--heavy-logit", type=float, default=8.0, help="extra logit of a heavy key for aligned queries")
    ap.add_argument("--configs", default="n64w4s3,n64w8s2,n128w8s2")
    ap.add_argument("--no-long-chunk", action="store_true", help="skip the whole-prompt chunk")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    thresholds = sorted(float(t) for t in args.thresholds.split(","))
    if thresholds[0] != 0:
        thresholds.insert(0, 0.0)
    configs = args.configs.split(",")
    meta = dict(device=torch.cuda.get_device_name(), heads=[HQ, HKV, D], block_size=BS, dtype="bfloat16")
    rows = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        for q_len in [args.chunk] + ([] if args.no_long_chunk else [ctx]):
            for heavy_frac in (float(f) for f in args.heavy_fracs.split(",")):
                rows += probe(ctx, q_len, thresholds, heavy_frac, args, configs, dev)
                torch.cuda.empty_cache()
                with open(args.out, "w") as f:  # after each probe: a run cut short keeps what it measured
                    json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
