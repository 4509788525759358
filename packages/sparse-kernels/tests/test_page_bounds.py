"""page_bounds (Triton and reference) against a per-page loop of Quest's bound."""

from __future__ import annotations

import pytest
import torch

from sparse_kernels import page_bounds


def _loop(q, kmin, kmax, tables, max_pages, sink, recent):
    batch, hq, _ = q.shape
    hkv = kmin.shape[1]
    g = hq // hkv
    out = torch.full((batch, hkv, max_pages), float("-inf"))
    for b, table in enumerate(tables):
        n = len(table)
        for h in range(hkv):
            for p, block in enumerate(table):
                if p < sink or p >= n - recent:
                    out[b, h, p] = float("inf")
                    continue
                per_head = [
                    torch.maximum(q[b, hh].float() * kmin[block, h].float(), q[b, hh].float() * kmax[block, h].float())
                    .sum()
                    .item()
                    for hh in range(h * g, (h + 1) * g)
                ]
                out[b, h, p] = max(per_head)
    return out


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize(("sink", "recent"), [(0, 0), (1, 2)])
def test_bounds_equal_the_loop(backend, sink, recent, triton_device):
    device = triton_device if backend == "triton" else "cpu"
    gen = torch.Generator().manual_seed(1)
    num_blocks, hkv, hq, d = 40, 2, 8, 32
    keys_a, keys_b = torch.randn(2, num_blocks, hkv, d, generator=gen).bfloat16()
    kmin, kmax = torch.minimum(keys_a, keys_b), torch.maximum(keys_a, keys_b)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [perm[:7], perm[7:8], perm[8:45]]  # lengths 7, 1, 32
    q = torch.randn(3, hq, d, generator=gen).bfloat16()
    max_pages = 36
    start = torch.tensor([0, 7, 8], dtype=torch.int64)
    num_pages = torch.tensor([7, 1, 32], dtype=torch.int32)
    indices = torch.tensor(sum(tables, []), dtype=torch.int32)
    out = torch.empty(3, hkv, max_pages, device=device)
    page_bounds(
        q.to(device),
        kmin.to(device),
        kmax.to(device),
        indices.to(device),
        start.to(device),
        num_pages.to(device),
        out,
        sink=sink,
        recent=recent,
        backend=backend,
    )
    torch.testing.assert_close(out.cpu(), _loop(q, kmin, kmax, tables, max_pages, sink, recent), rtol=1e-5, atol=1e-4)
