"""int8 block summaries with a scale per (block, KV head): the codes against a plain per-element
formula written here, the kernels (Triton and reference) equal to each other code for code, the
decode fold against the keys it summarises (outward: every key inside its block's bounds), and
Quest's coded page bounds still bounding every ``q . k`` of the page."""

from __future__ import annotations

import math

import pytest
import torch

from sparse_kernels import block_summary, page_bounds, update_block_summaries
from sparse_kernels.summary_codes import decode_summary, encode_summary


def _plain_codes(lo: list[float], hi: list[float]) -> tuple[list[int], list[int], float]:
    """One head's codes, element by element, in float32 arithmetic as the kernels do it."""
    f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    amax = max(max(abs(v) for v in lo), max(abs(v) for v in hi))
    scale = (f32(amax) / 127).item() if amax > 0 else 1.0
    cmin = [max(-127, min(127, math.floor((f32(v) / f32(scale)).item()))) for v in lo]
    cmax = [max(-127, min(127, math.ceil((f32(v) / f32(scale)).item()))) for v in hi]
    return cmin, cmax, scale


def _check_outward(kmin, kmax, scale, true_min, true_max):
    lo, hi = decode_summary(kmin, kmax, scale)
    slack = 1e-6 * scale[..., None] * 127  # float32 rounding of the scale
    assert bool((lo <= true_min.float() + slack).all()) and bool((hi >= true_max.float() - slack).all())


def test_codes_equal_the_plain_formula_and_bound_the_summary():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 6, 3, 24, generator=gen) * torch.tensor([0.01, 1.0, 300.0])[None, None, :, None]
    lo, hi = torch.minimum(a, b), torch.maximum(a, b)
    lo[0, 0] = hi[0, 0] = 0.0  # an all-zero head: scale 1, codes 0
    kmin, kmax, scale = encode_summary(lo, hi)
    assert kmin.dtype == kmax.dtype == torch.int8 and scale.dtype == torch.float32
    for n in range(6):
        for h in range(3):
            cmin, cmax, s = _plain_codes(lo[n, h].tolist(), hi[n, h].tolist())
            assert kmin[n, h].tolist() == cmin and kmax[n, h].tolist() == cmax and scale[n, h].item() == s
    assert scale[0, 0].item() == 1.0 and not kmin[0, 0].any() and not kmax[0, 0].any()
    _check_outward(kmin, kmax, scale, lo, hi)
    # Within one code of the value (outward rounding, nothing looser), and the head's extreme reaches +-127.
    dlo, dhi = decode_summary(kmin, kmax, scale)
    assert bool((lo - dlo <= scale[..., None] * (1 + 1e-5)).all()) and bool(
        (dhi - hi <= scale[..., None] * (1 + 1e-5)).all()
    )
    reach = torch.maximum(kmin.abs(), kmax.abs()).amax(-1)
    assert bool((reach[1:] == 127).all())


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_block_summary_codes_equal_encoding_the_min_max(backend, triton_device):
    device = triton_device if backend == "triton" else "cpu"
    gen = torch.Generator().manual_seed(1)
    num_blocks, bs, hkv, d = 9, 8, 2, 48  # d not a power of two: the masked channels
    k_cache = (torch.randn(num_blocks, bs, hkv, d, generator=gen) * 3).bfloat16()
    ids = torch.tensor([4, 0, 7, 2], dtype=torch.int32)
    valid = torch.tensor([8, 3, 0, 1], dtype=torch.int32)  # block 7: nothing valid, left as it was
    kmin = torch.full((num_blocks, hkv, d), 5, dtype=torch.int8)
    kmax, scale = kmin.clone(), torch.full((num_blocks, hkv), 0.5)
    outs = [t.to(device) for t in (kmin, kmax, scale)]
    block_summary(k_cache.to(device), ids.to(device), valid.to(device), *outs[:2], scale=outs[2], backend=backend)
    kmin, kmax, scale = (t.cpu() for t in outs)
    for i, n in zip(ids.tolist(), valid.tolist(), strict=True):
        if n == 0:
            assert (kmin[i] == 5).all() and (kmax[i] == 5).all() and (scale[i] == 0.5).all()
            continue
        keys = k_cache[i, :n].float()
        emin, emax, escale = encode_summary(keys.amin(0), keys.amax(0))
        assert torch.equal(kmin[i], emin) and torch.equal(kmax[i], emax) and torch.equal(scale[i], escale)
        _check_outward(kmin[i], kmax[i], scale[i], keys.amin(0), keys.amax(0))
    untouched = [b for b in range(num_blocks) if b not in (4, 0, 2)]
    assert (kmin[untouched] == 5).all() and (scale[untouched] == 0.5).all()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_decode_updates_keep_codes_a_fresh_encoding_of_the_block(backend, triton_device):
    """Three requests append one key per step (one skips steps: padding rows, slot -1); keys grow over
    time, so a block's scale grows mid-block. After every step each written block's codes and scale are
    exactly a fresh encoding of its keys so far (the block is re-summarized, never folded into rounded
    codes), every key lies inside the decoded bounds, and blocks nobody wrote are untouched."""
    device = triton_device if backend == "triton" else "cpu"
    gen = torch.Generator().manual_seed(2)
    num_blocks, bs, hkv, d = 10, 4, 2, 32
    k_cache = torch.zeros(num_blocks, bs, hkv, d, dtype=torch.bfloat16)
    kmin = torch.full((num_blocks, hkv, d), 9, dtype=torch.int8)
    kmax, scale = kmin.clone(), torch.full((num_blocks, hkv), 0.25)
    dev = [t.to(device) for t in (kmin, kmax, scale)]
    tables = [[3, 7, 1], [0, 9, 5], [8, 2, 6]]
    lengths = [0, 0, 0]
    for step in range(12):
        slots = []
        for r, table in enumerate(tables):
            if r == 2 and step % 3 == 1:
                slots.append(-1)
                continue
            pos = lengths[r]
            lengths[r] += 1
            slot = table[pos // bs] * bs + pos % bs
            slots.append(slot)
            k_cache.view(-1, hkv, d)[slot] = (torch.randn(hkv, d, generator=gen) * (1 + step)).bfloat16()
        slot_mapping = torch.tensor(slots, dtype=torch.int32, device=device)
        update_block_summaries(k_cache.to(device), slot_mapping, *dev[:2], scale=dev[2], backend=backend)
        got = [t.cpu() for t in dev]
        for r, table in enumerate(tables):
            for p in range(-(-lengths[r] // bs)):
                block, n = table[p], min(bs, lengths[r] - p * bs)
                keys = k_cache[block, :n].float()
                fresh = encode_summary(keys.amin(0), keys.amax(0))
                assert all(torch.equal(t[block], f) for t, f in zip(got, fresh, strict=True))
                _check_outward(got[0][block], got[1][block], got[2][block], keys.amin(0), keys.amax(0))
        assert (got[0][4] == 9).all() and (got[2][4] == 0.25).all()  # block 4: in no table


@pytest.mark.parametrize("backend", ["reference", "triton", "triton heads together"])
def test_coded_page_bounds_bound_every_key_and_equal_the_decoded_summaries(backend, triton_device, monkeypatch):
    device = "cpu" if backend == "reference" else triton_device
    if backend == "triton heads together":  # the kernel over all KV heads of a page
        from sparse_kernels._triton import page_bounds as kernel

        monkeypatch.setitem(kernel.CODES_CONFIG, "heads_together", True)
        backend = "triton"
    gen = torch.Generator().manual_seed(3)
    num_blocks, bs, hkv, hq, d = 30, 4, 2, 8, 64
    k_cache = (torch.randn(num_blocks, bs, hkv, d, generator=gen) * 2).bfloat16()
    ids = torch.arange(num_blocks, dtype=torch.int32)
    kmin = torch.empty(num_blocks, hkv, d, dtype=torch.int8)
    kmax, scale = torch.empty_like(kmin), torch.empty(num_blocks, hkv)
    block_summary(k_cache, ids, torch.full_like(ids, bs), kmin, kmax, scale=scale, backend="reference")
    perm = torch.randperm(num_blocks, generator=gen)
    lengths = [11, 1, 17]
    indices = perm[: sum(lengths)].to(torch.int32)
    start = torch.tensor([0, 11, 12])
    q = torch.randn(3, hq, d, generator=gen).bfloat16()
    max_pages = 20
    args = [q, kmin, kmax, indices, start, torch.tensor(lengths, dtype=torch.int32)]
    out = torch.empty(3, hkv, max_pages, device=device)
    page_bounds(*(a.to(device) for a in args), out, scale=scale.to(device), backend=backend)
    out = out.cpu()
    lo, hi = decode_summary(kmin, kmax, scale)
    expected = torch.empty(3, hkv, max_pages)
    page_bounds(q, lo, hi, *args[3:], expected, backend="reference")
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    g = hq // hkv
    for b, (s, n) in enumerate(zip(start.tolist(), lengths, strict=True)):
        for p in range(n):
            keys = k_cache[indices[s + p]].float()  # [bs, hkv, d]
            for h in range(hkv):
                best = (q[b, h * g : (h + 1) * g].float() @ keys[:, h].T).max()
                assert out[b, h, p] >= best - 1e-3 * best.abs().clamp(min=1)
        assert bool((out[b, :, n:] == float("-inf")).all())


def test_codes_need_their_scale_and_the_right_shapes():
    k_cache = torch.randn(4, 4, 2, 16)
    kmin = torch.zeros(4, 2, 16, dtype=torch.int8)
    ids = torch.tensor([0], dtype=torch.int32)
    with pytest.raises(ValueError, match="scale"):
        block_summary(k_cache, ids, ids + 1, kmin, kmin.clone())
    with pytest.raises(ValueError, match="scale"):
        block_summary(k_cache, ids, ids + 1, kmin, kmin.clone(), scale=torch.ones(4, 3))
    with pytest.raises(ValueError, match="int8"):
        update_block_summaries(k_cache, ids, torch.zeros(4, 2, 16), torch.zeros(4, 2, 16), scale=torch.ones(4, 2))
    out = torch.empty(1, 2, 4)
    with pytest.raises(ValueError, match="scale"):
        page_bounds(torch.randn(1, 4, 16), kmin, kmin, ids, ids, ids + 1, out)
