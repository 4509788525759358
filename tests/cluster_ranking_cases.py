"""Cases for the tests of RetroInfer's cluster ranking (``cluster_select``): random logits with empty columns
(and optionally tied columns, or columns whose scores differ only past the 16 mantissa bits the rank keeps), and
the plain float64 scores they rank by."""

from __future__ import annotations

import math

import torch


def plain_scores(logits, sizes):
    """float64 ``[n, H, Cw]`` scores, by the formula: sum over the group of each head's softmax."""
    n, heads, group, columns = logits.shape
    out = torch.full((n, heads, columns), float("-inf"), dtype=torch.float64)
    for r in range(n):
        for h in range(heads):
            live = [c for c in range(columns) if sizes[r, h, c] > 0]
            for g in range(group):
                top = max(float(logits[r, h, g, c]) for c in live) if live else 0.0
                total = sum(math.exp(float(logits[r, h, g, c]) - top) for c in live)
                for c in live:
                    p = math.exp(float(logits[r, h, g, c]) - top) / total
                    out[r, h, c] = p if g == 0 else out[r, h, c] + p
    return out


def case(seed, n=2, heads=2, group=4, columns=70, ties=False, low_bits=False):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, heads, group, columns, generator=gen) * 2
    if ties:  # whole columns repeated: equal scores, ranked by column
        logits = logits.round()
        logits[..., 1::3] = logits[..., ::3][..., : logits[..., 1::3].shape[-1]]
    if low_bits:  # a few levels, each column off by ~2e-6 (the same for the group): scores of a level mostly
        # differ only in their 7 lowest mantissa bits (a relative 2 ** -16 = 1.5e-5), tied once truncated
        level = torch.randint(-2, 3, (n, heads, 1, columns), generator=gen).float()
        logits = level + 2e-6 * torch.randn(n, heads, 1, columns, generator=gen)
        logits = logits.expand(n, heads, group, columns).clone()
    sizes = torch.randint(0, 4, (n, heads, columns), generator=gen, dtype=torch.int32)
    sizes[0, 1] = 0  # a row with no live cluster
    logits.masked_fill_((sizes == 0)[:, :, None], float("-inf"))
    return logits, sizes
