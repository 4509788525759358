"""Probe (not used by the engine): a per-row top-K selection for RetroInfer's ranking, to time against the
current ``cluster_order`` (a full order of the first ``top`` columns). One program per row finds the K-th
smallest of the row's unique int64 keys (descending score bits << 24 | column, as ``cluster_order`` packs
them) by a radix search, ``BITS`` bits per round (``2**BITS`` candidate thresholds counted at once),
then writes the K selected columns (column order) and, sorted, the best ``R`` of them.

Why: the engine needs an exact order only for the clusters a row can read (~150 at 128K) and the next
clusters as a set; ``cluster_order`` orders ~5.4K of 8.3K columns per row (80-105 us per layer on the H200).

    python benchmarks/cluster_topk_probe.py --device cuda     # times it beside cluster_order
    python benchmarks/cluster_topk_probe.py --device cpu      # interpreted, small sizes: checks it
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from sparse_kernels._triton.launch import Kernel

SHIFT = 24
PAD = 1 << 62
KEY_BITS = 56  # 32 score bits above 24 column bits


def _topk_kernel(
    score_ptr, key_ptr, set_ptr, best_ptr, columns, K, R,
    BLOCK: tl.constexpr, SUB: tl.constexpr, BITS: tl.constexpr, ROUNDS: tl.constexpr, BLOCK_R: tl.constexpr,
    SHIFT: tl.constexpr, PAD: tl.constexpr, KEY_BITS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    for c0 in range(0, BLOCK, SUB):  # the keys, once, to a scratch row (counted SUB at a time below)
        col = c0 + tl.arange(0, SUB)
        cm = col < columns
        score = tl.load(score_ptr + row * columns + col, mask=cm, other=float("-inf")) + 0.0
        bits = score.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        ascending = tl.where(bits >= 0x80000000, 0xFFFFFFFF - bits, bits + 0x80000000)
        key = tl.where(cm, ((0xFFFFFFFF - ascending) << SHIFT) | col.to(tl.int64), PAD)
        tl.store(key_ptr + row * BLOCK + col, key)
    tl.debug_barrier()
    # the K-th smallest key and the R-th: the largest x with fewer than K (R) keys below it, BITS bits a round
    digits = tl.arange(0, 1 << BITS)  # candidate digits (0 always counts: fewer than K keys lie below found)
    found_k = tl.sum(tl.zeros([SUB], tl.int64), axis=0)
    found_r = tl.sum(tl.zeros([SUB], tl.int64), axis=0)
    for rnd in tl.static_range(ROUNDS):
        shift = KEY_BITS - (rnd + 1) * BITS
        trial_k = found_k + (digits.to(tl.int64) << shift)  # [D]
        trial_r = found_r + (digits.to(tl.int64) << shift)
        below_k = tl.zeros([1 << BITS], tl.int32)
        below_r = tl.zeros([1 << BITS], tl.int32)
        for c0 in range(0, BLOCK, SUB):
            key = tl.load(key_ptr + row * BLOCK + c0 + tl.arange(0, SUB))
            below_k += tl.sum((key[:, None] < trial_k[None, :]).to(tl.int32), axis=0)  # [D], rising
            below_r += tl.sum((key[:, None] < trial_r[None, :]).to(tl.int32), axis=0)
        found_k += (tl.sum((below_k < K).to(tl.int64), axis=0) - 1) << shift  # the largest digit below K
        found_r += (tl.sum((below_r < R).to(tl.int64), axis=0) - 1) << shift
    taken_k = tl.sum(tl.zeros([SUB], tl.int32), axis=0)
    taken_r = tl.sum(tl.zeros([SUB], tl.int32), axis=0)
    for c0 in range(0, BLOCK, SUB):  # exactly K keys lie at or below found_k (keys are unique), R at found_r
        col = c0 + tl.arange(0, SUB)
        key = tl.load(key_ptr + row * BLOCK + col)
        chosen = key <= found_k
        slot = taken_k + tl.cumsum(chosen.to(tl.int32), axis=0) - 1
        tl.store(set_ptr + row * K + slot, col.to(tl.int64), mask=chosen)
        taken_k += tl.sum(chosen.to(tl.int32), axis=0)
        best = key <= found_r
        at = taken_r + tl.cumsum(best.to(tl.int32), axis=0) - 1
        tl.store(best_ptr + row * BLOCK_R + at, key, mask=best)
        taken_r += tl.sum(best.to(tl.int32), axis=0)
    tl.debug_barrier()
    r = tl.arange(0, BLOCK_R)
    top = tl.sort(tl.load(best_ptr + row * BLOCK_R + r, mask=r < R, other=PAD))
    tl.debug_barrier()
    tl.store(best_ptr + row * BLOCK_R + r, top & ((1 << SHIFT) - 1), mask=r < R)


TOPK = Kernel(_topk_kernel)


def topk(scores: torch.Tensor, k: int, r: int, bits: int = 4, warps: int = 16, sub: int = 512):
    """``(set, best)``: int64 ``[rows, k]`` the best ``k`` columns (column order), ``[rows, BLOCK_R]`` the best
    ``r`` in order (first ``r`` entries)."""
    rows, columns = scores.shape
    assert KEY_BITS % bits == 0 and 1 <= r <= k <= columns
    block, block_r = triton.next_power_of_2(columns), triton.next_power_of_2(r)
    sub = min(sub, block)
    keys = torch.empty(rows, block, dtype=torch.int64, device=scores.device)
    out_set = torch.empty(rows, k, dtype=torch.int64, device=scores.device)
    best = torch.empty(rows, block_r, dtype=torch.int64, device=scores.device)
    TOPK[(rows,)](
        scores.contiguous(), keys, out_set, best, columns, k, r, BLOCK=block, SUB=sub, BITS=bits,
        ROUNDS=KEY_BITS // bits, SHIFT=SHIFT, PAD=PAD, KEY_BITS=KEY_BITS,
        BLOCK_R=block_r, num_warps=warps,
    )  # fmt: skip
    return out_set, best


def reference(scores: torch.Tensor, k: int, r: int):
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return order[:, :k].sort(-1).values, order[:, :r]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    dev = torch.device(args.device)
    gen = torch.Generator(device=dev).manual_seed(0)
    if dev.type == "cpu":
        cases = [(4, 90, 30, 7), (3, 200, 120, 16)]
    else:
        cases = [(40, 8320, 147 + 1930, 147), (40, 8320, 5426, 256)]
    for rows, columns, k, r in cases:
        scores = torch.rand(rows, columns, device=dev, generator=gen) ** 4
        scores[0, :5] = scores[0, 5]  # ties: ranked by column
        scores[1, ::7] = float("-inf")  # empty clusters
        want_set, want_best = reference(scores, k, r)
        settings = [(2, 16, 64), (4, 16, 64)] if dev.type == "cpu" else []
        if dev.type == "cuda":
            settings = [(b, w, sub) for b in (2, 4, 8) for w in (8, 16, 32) for sub in (256, 1024) if b * sub <= 8192]
        for bits, warps, sub in settings:
            got_set, got_best = topk(scores, k, r, bits=bits, warps=warps, sub=sub)
            ok = torch.equal(got_set.sort(-1).values, want_set) and torch.equal(got_best[:, :r], want_best)
            line = f"rows {rows} columns {columns} k {k} r {r} bits {bits} warps {warps} sub {sub}: equal {ok}"
            if dev.type == "cuda":
                from retroinfer_kernel_probe import graph_ms

                ms = graph_ms(
                    lambda sc=scores, kk=k, rr=r, b=bits, w=warps, s=sub: topk(sc, kk, rr, bits=b, warps=w, sub=s)
                )
                line += f", {ms * 1e3:.1f} us"
            print(line)
    if dev.type == "cuda":
        from retroinfer_kernel_probe import graph_ms

        for rows, columns, k, _ in cases:
            scores = torch.rand(rows, columns, device=dev, generator=gen)
            ms = graph_ms(lambda s=scores, kk=k: torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :kk])
            print(f"torch stable sort, rows {rows} columns {columns}: {ms * 1e3:.1f} us")


if __name__ == "__main__":
    main()
