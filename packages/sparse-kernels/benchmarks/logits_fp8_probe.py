"""A filter layer's two passes over a whole context (OmniKV): ``paged_logits`` (keys) and ``logits_attention``
(values), over bf16 K/V and over fp8 codes with their (token, head) scales, for launch shapes side by side.

One layer of the Qwen3-8B shape (8 KV heads, 32 query heads, head_dim 128) at ``--context`` tokens per row,
pages of 16 in shuffled order; each variant's time is a CUDA-event median, its bandwidth the bytes it must
read (keys or values with their scales, plus the logits it writes or reads) over the device's copy bandwidth.
Outputs are compared with the default launch's (max abs difference). Prints one JSON line per variant.

    python packages/sparse-kernels/benchmarks/logits_fp8_probe.py --batches 5,11 --context 131072
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import copy_bandwidth, median_ms  # noqa: E402

from sparse_kernels import paged_logits  # noqa: E402
from sparse_kernels._triton import logits_attention as la_kernel  # noqa: E402
from sparse_kernels._triton import paged_logits as pl_kernel  # noqa: E402
from sparse_kernels.logits_attention import logits_attention, logits_lse  # noqa: E402

HKV, HQ, D, BS = 8, 32, 128, 16


def _pool(batch: int, context: int, fp8: bool):
    pages = batch * context // BS
    shape = (pages, BS, HKV, D)
    k = torch.randn(shape, device="cuda")
    v = torch.randn(shape, device="cuda")
    if not fp8:
        return k.bfloat16(), v.bfloat16(), None, None
    ks = k.abs().amax(-1) / 448.0
    vs = v.abs().amax(-1) / 448.0
    return (k / ks[..., None]).to(torch.float8_e4m3fn), (v / vs[..., None]).to(torch.float8_e4m3fn), ks, vs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="5,11")
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--block-n", default="32,64,128")
    ap.add_argument("--warps", default="1,2,4")
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--per-sm", default="8,16,32")
    args = ap.parse_args()
    copy = copy_bandwidth()
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    for batch in map(int, args.batches.split(",")):
        pages = batch * args.context // BS
        rows = dict(
            table=torch.randperm(pages, generator=gen).to("cuda", torch.int32),
            starts=torch.arange(batch, device="cuda", dtype=torch.int64) * (args.context // BS),
            lens=torch.full((batch,), args.context, device="cuda", dtype=torch.int64),
        )
        q = torch.randn(batch, HQ, D, generator=gen).to("cuda", torch.bfloat16)
        for fp8 in (False, True):
            _sweep(args, batch, fp8, q, rows, copy)  # its pool is freed on return
            torch.cuda.empty_cache()


def _print_error(row: dict, e: Exception) -> None:  # a shape the compiler rejects (shared memory)
    print(json.dumps({**row, "error": str(e)[:120]}), flush=True)


def _sweep(args, batch: int, fp8: bool, q: torch.Tensor, rows: dict, copy: float) -> None:
    """Every launch shape of both kernels over one pool (bf16 or fp8) of ``batch`` rows."""
    k, v, ks, vs = _pool(batch, args.context, fp8)
    table, starts, lens = rows["table"], rows["starts"], rows["lens"]
    itemsize = 1 if fp8 else 2
    read = batch * args.context * HKV * (D * itemsize + (4 if fp8 else 0)) / 2 + batch * HQ * args.context * 4
    logits = torch.empty(batch, HQ, args.context, device="cuda")
    lse = torch.empty(batch, HQ, device="cuda")
    out = torch.empty(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    pl_cfg = pl_kernel.FP8_CONFIG if fp8 else pl_kernel.CONFIG
    la_cfg = la_kernel.FP8_CONFIG if fp8 else la_kernel.CONFIG
    pl_default, la_default = dict(pl_cfg), dict(la_cfg)

    def run_logits():
        paged_logits(q, k, table, starts, lens, logits, scale=D**-0.5, k_scale=ks)

    def run_attention():
        logits_attention(logits, lse, v, table, starts, lens, out, v_scale=vs)

    run_logits()
    lse.copy_(logits_lse(logits))
    ref_logits = logits.clone()
    run_attention()
    ref_out = out.float().clone()
    grid = itertools.product(
        map(int, args.block_n.split(",")), map(int, args.warps.split(",")), map(int, args.stages.split(","))
    )
    for block_n, warps, stages in grid:
        row = dict(kernel="paged_logits", batch=batch, fp8=fp8, block_n=block_n, warps=warps, stages=stages)
        pl_cfg.update(BLOCK_N=block_n, num_warps=warps, num_stages=stages)
        try:
            ms = median_ms(run_logits)
        except Exception as e:
            _print_error(row, e)
            continue
        diff = float((logits - ref_logits).abs().nan_to_num(0.0, 0.0, 0.0).max())
        row.update(us=round(ms * 1e3, 1), copy_frac=round(read / (ms * 1e-3) / copy, 3), max_diff=diff)
        print(json.dumps(row), flush=True)
        for per_sm in map(int, args.per_sm.split(",")):
            row = dict(kernel="logits_attention", batch=batch, fp8=fp8, block_n=block_n, warps=warps)
            row.update(stages=stages, per_sm=per_sm)
            la_cfg.update(BLOCK_N=block_n, num_warps=warps, num_stages=stages, programs_per_sm=per_sm)
            try:
                ms = median_ms(run_attention)
            except Exception as e:
                _print_error(row, e)
                continue
            diff = float((out.float() - ref_out).abs().max())
            row.update(us=round(ms * 1e3, 1), copy_frac=round(read / (ms * 1e-3) / copy, 3), max_diff=diff)
            print(json.dumps(row), flush=True)
    pl_cfg.clear(), pl_cfg.update(pl_default)
    la_cfg.clear(), la_cfg.update(la_default)


if __name__ == "__main__":
    main()
