"""selection_entries (Triton and reference) against a per-entry loop through the block tables: pages
to block ids, tokens to slot ids, entries past a row clamped to its last page / token, expanded heads."""

from __future__ import annotations

import pytest
import torch

from sparse_kernels.selection_entries import selection_entries


def _loop(chosen, tables, kv_lens, block_size, page_size):
    out = torch.empty(chosen.shape, dtype=torch.int32)
    for b, table in enumerate(tables):
        n = kv_lens[b]
        for h in range(chosen.shape[1]):
            for j in range(chosen.shape[2]):
                c = int(chosen[b, h, j])
                if page_size == block_size:
                    out[b, h, j] = table[min(c, -(-n // block_size) - 1)]
                else:
                    t = min(c, n - 1)
                    out[b, h, j] = table[t // block_size] * block_size + t % block_size
    return out


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("page_size", [16, 1])
@pytest.mark.parametrize("expanded", [False, True])
def test_entries_equal_the_loop(backend, page_size, expanded, triton_device):
    device = triton_device if backend == "triton" else "cpu"
    gen = torch.Generator().manual_seed(page_size + expanded)
    bs, heads = 16, 3
    kv_lens = [1, 40, 100, 17]
    perm = torch.randperm(64, generator=gen).tolist()
    tables, at = [], 0
    for n in kv_lens:
        tables.append(perm[at : at + -(-n // bs)])
        at += len(tables[-1])
    starts = torch.tensor([0, *torch.tensor([len(t) for t in tables]).cumsum(0)[:-1].tolist()])
    indices = torch.tensor(sum(tables, []), dtype=torch.int32)
    size = 9
    limit = 8 if page_size == bs else 110  # some entries past each row
    if expanded:
        chosen = torch.randint(0, limit, (4, 1, size), generator=gen).expand(-1, heads, -1)
    else:
        chosen = torch.randint(0, limit, (4, heads, size), generator=gen)
    out = torch.full((4, heads, size), -1, dtype=torch.int32, device=device)
    got = selection_entries(
        chosen.to(device),
        indices.to(device),
        starts.to(device),
        torch.tensor(kv_lens).to(device),
        out,
        block_size=bs,
        page_size=page_size,
        backend=backend,
    )
    assert got is out
    assert torch.equal(out.cpu(), _loop(chosen, tables, kv_lens, bs, page_size))
