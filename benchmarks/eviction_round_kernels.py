"""The two device costs of a decode-time eviction round (issue 15), old against new, one layer at a time.

Shape of SnapKV's round at batch 91 with ``decode_eviction_interval 256`` (Qwen3-8B: 8 KV heads,
head_dim 128, bf16; 16-slot blocks in shuffled order): every request holds 8448 slots, keeps 8192 (sink
64, recent 512, the best 7616 of the middle by random scores over ``8448 - window`` columns), per KV head
(SnapKV's scores) or one row shared by all heads (a method scoring one row). Also at batch 5.

- Compaction (``compact_kv``): the kernel of main at 19c503e (copied below as the baseline: 64-row
  chunks, a serial load / barrier / store per chunk, the shared row materialized per head) against the
  current one (prefetched indices, rows already in place skipped, a shared row read with head stride 0),
  its launch swept over ``SWEEP``. GB/s counts the K and V rows the old kernel reads and writes (every
  kept row); ``moving`` is the share of them not already in place (all the new kernel touches).
- Selection (``keep_indices_batch``): the two stable sorts (``keep_indices_batch_reference``, what main
  ran) against the topk selection, and for comparison ``sparse_kernels.top_k_ascending`` (one Triton
  select per row) on the same middle.

Every variant's output is checked equal to the reference first (caches compacted from the same start).
CUDA events, after a warm-up, median of 7 runs of the mean of a few back-to-back calls.

    PYTHONPATH=$(ls -d packages/*/src | tr '\\n' ':') python3 benchmarks/eviction_round_kernels.py \\
        [--batches 91,5] [--no-sweep] [--json OUT.json]
    ... benchmarks/eviction_round_kernels.py --device cpu --small   # a quick run through the interpreter
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "packages/sparse-kernels/benchmarks"))
from _timing import copy_bandwidth, median_ms  # noqa: E402

from sparse_kernels import compact_kv, top_k_ascending  # noqa: E402
from sparse_kernels._triton import compact as new_kernel  # noqa: E402
from sparse_kernels._triton.launch import Kernel  # noqa: E402
from sparse_methods.keep_selection import keep_indices_batch, keep_indices_batch_reference  # noqa: E402

FULL = dict(kv_len=8448, budget=8192, sink=64, recent=512, window=32, heads=8, head_dim=128, block=16)
SMALL = dict(kv_len=300, budget=260, sink=4, recent=16, window=8, heads=2, head_dim=16, block=16)
SWEEP = [(64, 4), (128, 4), (128, 8), (256, 8), (256, 16)]  # (rows per chunk, warps)


def _old_compact_kernel(
    k_ptr, v_ptr, slot_indptr_ptr, slot_ids_ptr, keep_indptr_ptr, keep_ptr, stride_keep_h,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """main's kernel at 19c503e, unchanged (the baseline)."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    slot_lo = tl.load(slot_indptr_ptr + r)
    keep_lo = tl.load(keep_indptr_ptr + r)
    num_keep = tl.load(keep_indptr_ptr + r + 1) - keep_lo
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    for i0 in range(0, num_keep, BLOCK):
        offs = i0 + tl.arange(0, BLOCK)
        mask = offs < num_keep
        src_pos = tl.load(keep_ptr + h * stride_keep_h + keep_lo + offs, mask=mask, other=0)
        src = tl.load(slot_ids_ptr + slot_lo + src_pos, mask=mask, other=0).to(tl.int64)
        dst = tl.load(slot_ids_ptr + slot_lo + offs, mask=mask, other=0).to(tl.int64)
        m2 = mask[:, None] & mask_d[None, :]
        src_off = (src[:, None] * NUM_KV_HEADS + h) * HEAD_DIM + offs_d[None, :]
        dst_off = (dst[:, None] * NUM_KV_HEADS + h) * HEAD_DIM + offs_d[None, :]
        k = tl.load(k_ptr + src_off, mask=m2)
        v = tl.load(v_ptr + src_off, mask=m2)
        tl.debug_barrier()
        tl.store(k_ptr + dst_off, k, mask=m2)
        tl.store(v_ptr + dst_off, v, mask=m2)


old_kernel = Kernel(_old_compact_kernel)


def old_compact(k, v, slot_indptr, slot_ids, keep_indptr, keep) -> None:
    heads, head_dim = k.shape[2], k.shape[3]
    old_kernel[(slot_indptr.numel() - 1, heads)](
        k, v, slot_indptr, slot_ids, keep_indptr, keep, keep.stride(0),
        NUM_KV_HEADS=heads, HEAD_DIM=head_dim, BLOCK=64, BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4, num_stages=1,
    )  # fmt: skip


def keep_by_top_k_kernel(scores, kv_lens, *, sink, recent, num_middle) -> torch.Tensor:
    """``keep_indices_batch`` with the middle's pick by ``sparse_kernels.top_k_ascending`` (comparison only)."""
    b, h, m = scores.shape
    mid_hi = (kv_lens - recent).view(b, 1, 1)
    outside = torch.arange(sink, m, device=scores.device).view(1, 1, -1) >= mid_hi
    middle = scores[:, :, sink:].float().masked_fill(outside, float("-inf"))
    head = torch.arange(sink, device=scores.device).expand(b, h, sink)
    tail = (mid_hi + torch.arange(recent, device=scores.device).view(1, 1, -1)).expand(b, h, recent)
    return torch.cat([head, top_k_ascending(middle, num_middle).add_(sink), tail], dim=2)


class Round:
    """One layer's round at ``batch`` requests: caches over shuffled blocks, slot lists, scores, keeps."""

    def __init__(self, batch: int, shape: dict, device: str, gen: torch.Generator):
        s = self.shape = shape
        pages = -(-s["kv_len"] // s["block"])
        num_blocks = batch * pages + 3
        table = torch.randperm(num_blocks, generator=gen)[: batch * pages].view(batch, pages)
        slots = (table[..., None] * s["block"] + torch.arange(s["block"])).view(batch, -1)[:, : s["kv_len"]]
        self.slot_ids = slots.reshape(-1).to(torch.int32).to(device)
        self.slot_indptr = (torch.arange(batch + 1) * s["kv_len"]).to(torch.int32).to(device)
        self.keep_indptr = (torch.arange(batch + 1) * s["budget"]).to(torch.int32).to(device)
        self.kv_lens = torch.full((batch,), s["kv_len"], dtype=torch.int64, device=device)
        m = s["kv_len"] - s["window"]
        on_device = torch.Generator(device).manual_seed(batch)  # GBs of caches: drawn where they live
        self.scores = torch.rand(batch, s["heads"], m, generator=on_device, device=device)
        cache = (num_blocks, s["block"], s["heads"], s["head_dim"])
        self.k = torch.randn(cache, generator=on_device, device=device, dtype=torch.bfloat16)
        self.v = torch.randn(cache, generator=on_device, device=device, dtype=torch.bfloat16)
        self.select = dict(sink=s["sink"], recent=s["recent"], num_middle=s["budget"] - s["sink"] - s["recent"])

    def columns(self, keep: torch.Tensor) -> torch.Tensor:
        """``[B, H', n]`` keeps as ``compact_kv``'s ``[H, B n]`` (one row: head stride 0)."""
        cols = keep.transpose(0, 1).reshape(keep.shape[1], -1)
        return cols.expand(self.shape["heads"], -1) if keep.shape[1] == 1 else cols

    def moving_share(self, cols: torch.Tensor) -> float:
        local = torch.arange(self.shape["budget"], device=cols.device).repeat(cols.shape[1] // self.shape["budget"])
        return float((cols != local).float().mean())

    def kept_bytes(self) -> int:
        """K and V rows of every kept slot and head, read and written."""
        s = self.shape
        return 2 * 2 * (self.keep_indptr.numel() - 1) * s["budget"] * s["heads"] * s["head_dim"] * 2


def timer(device: str) -> Callable[[Callable[[], object]], float]:
    if device == "cuda":
        return lambda fn: median_ms(fn, iters=5, reps=7)

    def cpu_ms(fn):
        fn()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    return cpu_ms


def compaction_rows(r: Round, device: str, sweep: bool) -> list[dict]:
    ms_of, out = timer(device), []
    for kind, score_rows in (("per_head", r.scores), ("shared", r.scores[:, :1])):
        cols = r.columns(keep_indices_batch(score_rows, r.kv_lens, **r.select))
        dense = cols.contiguous()  # what main compacted from (the shared row expanded per head)
        k_ref, v_ref = r.k.clone(), r.v.clone()
        compact_kv(k_ref, v_ref, r.slot_ids, dense, slot_indptr=r.slot_indptr, keep_indptr=r.keep_indptr,
                   backend="reference")  # fmt: skip
        variants = {"old": lambda k, v, dense=dense: old_compact(k, v, r.slot_indptr, r.slot_ids, r.keep_indptr, dense)}
        configs = SWEEP if sweep else [(new_kernel.BLOCK_ROWS, new_kernel.NUM_WARPS)]
        for rows, warps in configs:
            default = (rows, warps) == (new_kernel.BLOCK_ROWS, new_kernel.NUM_WARPS)
            variants[f"new {rows}x{warps}" + (" (default)" if default else "")] = (
                lambda k, v, rows=rows, warps=warps, cols=cols: new_kernel.compact_kv_triton(
                    k, v, r.slot_indptr, r.slot_ids, r.keep_indptr, cols, block_rows=rows, num_warps=warps
                )
            )
        moving = r.moving_share(cols)
        for name, fn in variants.items():
            k, v = r.k.clone(), r.v.clone()
            fn(k, v)
            ok = torch.equal(k, k_ref) and torch.equal(v, v_ref)
            ms = ms_of(lambda fn=fn, k=k, v=v: fn(k, v))  # compacting again moves the same rows
            gbs = r.kept_bytes() / (ms * 1e-3) / 1e9
            out.append(dict(part="compact", keep=kind, variant=name, ms=ms, gb_s=gbs, moving=moving, equal=ok))
            del k, v
    return out


def selection_rows(r: Round, device: str) -> list[dict]:
    ms_of, out = timer(device), []
    for kind, scores in (("per_head", r.scores), ("shared", r.scores[:, :1].contiguous())):
        expected = keep_indices_batch_reference(scores, r.kv_lens, **r.select)
        variants = {
            "old (two sorts)": keep_indices_batch_reference,
            "new (topk)": keep_indices_batch,
            "top_k_ascending": keep_by_top_k_kernel,
        }
        for name, fn in variants.items():
            got = fn(scores, r.kv_lens, **r.select)
            ms = ms_of(lambda fn=fn, scores=scores: fn(scores, r.kv_lens, **r.select))
            out.append(dict(part="select", keep=kind, variant=name, ms=ms, equal=bool(torch.equal(got, expected))))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--small", action="store_true", help="a small shape (with --device cpu: the interpreter)")
    parser.add_argument("--batches", default="91,5")
    parser.add_argument("--no-sweep", action="store_true", help="time the default launch of the new kernel only")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    shape = SMALL if args.small else FULL
    batches = [int(b) for b in args.batches.split(",")] if not args.small else [3, 2]
    records = []
    if args.device == "cuda":
        print(f"{torch.cuda.get_device_name()}: copy_ {copy_bandwidth() / 1e9:.0f} GB/s (read + write)")
    for batch in batches:
        r = Round(batch, shape, args.device, torch.Generator().manual_seed(batch))
        rows = compaction_rows(r, args.device, sweep=not args.no_sweep) + selection_rows(r, args.device)
        for row in rows:
            row["batch"] = batch
            extra = f"{row['gb_s']:7.1f} GB/s  moving {row['moving']:.3f}" if row["part"] == "compact" else ""
            print(f"b{batch:<3} {row['part']:8} {row['keep']:8} {row['variant']:24} {row['ms']:9.3f} ms  {extra}  "
                  f"{'equal' if row['equal'] else 'DIFFERS'}")  # fmt: skip
        records += rows
        del r
    if args.json:
        args.json.write_text(json.dumps(dict(shape=shape, rows=records), indent=1))
    if not all(row["equal"] for row in records):
        sys.exit("a variant differs from the reference")


if __name__ == "__main__":
    main()
