"""Cases for the tests of RetroInfer's cluster ranking (``cluster_select``): random logits with empty columns
(and optionally tied columns), and the plain float64 scores they rank by."""

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


def case(seed, n=2, heads=2, group=4, columns=70, ties=False):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, heads, group, columns, generator=gen) * 2
    if ties:  # whole columns repeated: equal scores, ranked by column
        logits = logits.round()
        logits[..., 1::3] = logits[..., ::3][..., : logits[..., 1::3].shape[-1]]
    sizes = torch.randint(0, 4, (n, heads, columns), generator=gen, dtype=torch.int32)
    sizes[0, 1] = 0  # a row with no live cluster
    logits.masked_fill_((sizes == 0)[:, :, None], float("-inf"))
    return logits, sizes
