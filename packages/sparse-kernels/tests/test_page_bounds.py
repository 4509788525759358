"""page_bounds (Triton and reference) against a per-page loop of Quest's bound."""

from __future__ import annotations

import pytest
import torch

from sparse_kernels import page_bounds

TOGETHER = "triton heads together"  # the Triton kernel's variant over all KV heads of a page


def _backend(backend: str, monkeypatch) -> str:
    """The ``page_bounds`` backend for a test's ``backend``: ``TOGETHER`` is Triton with ``heads_together``
    set in both launch configs (model-dtype summaries and int8 codes) for the test."""
    if backend != TOGETHER:
        return backend
    from sparse_kernels._triton import page_bounds as kernel

    for config in (kernel.CONFIG, kernel.CODES_CONFIG):
        monkeypatch.setitem(config, "heads_together", True)
    return "triton"


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


@pytest.mark.parametrize("backend", ["reference", "triton", TOGETHER])
@pytest.mark.parametrize(("sink", "recent"), [(0, 0), (1, 2)])
def test_bounds_equal_the_loop(backend, sink, recent, triton_device, monkeypatch):
    device = "cpu" if backend == "reference" else triton_device
    backend = _backend(backend, monkeypatch)
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


# Many one-step chunks per row, head_dim 96 (the masked load along d) / one long loop per row.
@pytest.mark.parametrize(("target_programs", "head_dim"), [(2048, 96), (8, 64)])
def test_awkward_batch_matches_the_reference_and_selects_as_it(target_programs, head_dim, triton_device, monkeypatch):
    """Batch 17, up to 97 pages per row, pools in shuffled order, runs of pages with one summary (equal
    bounds, ties at the threshold): Triton's bounds equal the reference's, and Quest's pick on them
    (``top_k_ascending``) keeps the earlier of equal pages."""
    from sparse_kernels import top_k_ascending
    from sparse_kernels._triton import page_bounds as kernel
    from sparse_kernels._triton import stream_split

    monkeypatch.setattr(stream_split, "TARGET_PROGRAMS", target_programs)
    monkeypatch.setitem(kernel.CONFIG, "BLOCK_P", 16)
    gen = torch.Generator().manual_seed(head_dim)
    batch, hkv, hq, max_pages = 17, 2, 8, 100
    lengths = [97, 1, 40, *torch.randint(1, 98, (14,), generator=gen).tolist()]
    num_blocks = sum(lengths) + 3
    keys_a, keys_b = torch.randn(2, num_blocks, hkv, head_dim, generator=gen).bfloat16()
    kmin, kmax = torch.minimum(keys_a, keys_b), torch.maximum(keys_a, keys_b)
    perm = torch.randperm(num_blocks, generator=gen)
    tied = perm[: num_blocks // 2]  # half the blocks share one summary, above the rest: ties at the threshold
    kmin[tied], kmax[tied] = kmin[perm[0]].clone(), (kmax[perm[0]] + 2).clone()
    indices = perm[: sum(lengths)].to(torch.int32)
    start = torch.tensor([0, *torch.tensor(lengths).cumsum(0)[:-1].tolist()])
    q = torch.randn(batch, hq, head_dim, generator=gen).bfloat16()
    args = (q, kmin, kmax, indices, start, torch.tensor(lengths, dtype=torch.int32))
    expected = torch.empty(batch, hkv, max_pages)
    page_bounds(*args, expected, sink=2, recent=3, backend="reference")
    out = torch.empty(batch, hkv, max_pages, device=triton_device)
    page_bounds(*(a.to(triton_device) for a in args), out, sink=2, recent=3, backend="triton")
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-4)
    chosen = top_k_ascending(out, 9, backend="triton").cpu()
    assert torch.equal(chosen, top_k_ascending(out.cpu(), 9, backend="reference"))
    split_ties = 0
    for b, h in ((b, h) for b in range(batch) for h in range(hkv)):  # ties resolved to the earlier page
        bounds, picked = out[b, h].cpu(), set(chosen[b, h].tolist())
        equal = (bounds == bounds[chosen[b, h]].min()).nonzero().flatten().tolist()
        taken = [p in picked for p in equal]
        assert taken == sorted(taken, reverse=True)
        split_ties += not all(taken)
    assert split_ties >= 10  # most rows cut a run of equal bounds


@pytest.mark.parametrize(
    ("summaries", "hkv", "hq", "head_dim", "target_programs"),
    [
        ("bf16", 2, 8, 96, 8),  # group 4, the masked load along d, long loops
        ("codes", 3, 15, 96, 2048),  # group 5, KV heads padded to 4 rows a page, one-step chunks
        ("codes", 8, 32, 128, 8),  # Qwen3-8B's heads
        ("levels", 4, 8, 64, 64),  # group 2, KIVI's fp16 (min, step) statistics
    ],
)
def test_heads_together_equals_the_reference(summaries, hkv, hq, head_dim, target_programs, triton_device, monkeypatch):
    """The heads-together kernel (all KV heads of a page in one tile, dotted against all query heads, each
    row keeping its own group's columns) over awkward batches: bounds equal the reference's, in float32 and
    rounded to bfloat16, pages forced and past the row included."""
    from sparse_kernels._triton import page_bounds as kernel
    from sparse_kernels._triton import stream_split
    from sparse_kernels.summary_codes import encode_summary

    monkeypatch.setattr(stream_split, "TARGET_PROGRAMS", target_programs)
    for config in (kernel.CONFIG, kernel.CODES_CONFIG):
        monkeypatch.setitem(config, "heads_together", True)
        monkeypatch.setitem(config, "BLOCK_P_TOGETHER", 4)  # raised to 16 // heads pages (tl.dot's M >= 16)
    gen = torch.Generator().manual_seed(hkv * head_dim)
    batch, max_pages = 6, 40
    lengths = [37, 1, *torch.randint(1, 38, (batch - 2,), generator=gen).tolist()]
    num_blocks = sum(lengths) + 5
    a, b = (torch.randn(2, num_blocks, hkv, head_dim, generator=gen) * 3).bfloat16()
    kmin, kmax = torch.minimum(a, b), torch.maximum(a, b)
    scale, levels = None, 0
    if summaries == "codes":
        kmin, kmax, scale = encode_summary(kmin, kmax)
    elif summaries == "levels":
        levels = 15
        kmin, kmax = kmin.half(), ((kmax.float() - kmin.float()) / levels).half()
    indices = torch.randperm(num_blocks, generator=gen)[: sum(lengths)].to(torch.int32)
    start = torch.tensor([0, *torch.tensor(lengths).cumsum(0)[:-1].tolist()])
    q = torch.randn(batch, hq, head_dim, generator=gen).bfloat16()
    args = (q, kmin, kmax, indices, start, torch.tensor(lengths, dtype=torch.int32))
    for dtype in (torch.float32, torch.bfloat16):
        expected = torch.empty(batch, hkv, max_pages, dtype=dtype)
        page_bounds(*args, expected, sink=2, recent=3, scale=scale, levels=levels, backend="reference")
        out = torch.empty(batch, hkv, max_pages, dtype=dtype, device=triton_device)
        coding = {"scale": None if scale is None else scale.to(triton_device), "levels": levels}
        page_bounds(*(t.to(triton_device) for t in args), out, sink=2, recent=3, **coding, backend="triton")
        rtol = 1e-5 if dtype == torch.float32 else 8e-3  # bfloat16: one rounding step apart at most
        torch.testing.assert_close(out.cpu(), expected, rtol=rtol, atol=1e-4)
        assert bool((out[:, :, 0].cpu() == float("inf")).all()) and bool((out[1, :, 1:].cpu() == float("-inf")).all())


@pytest.mark.parametrize("backend", ["reference", "triton", TOGETHER])
@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_statistics_bound_every_page_of_dequantized_keys(backend, bits, triton_device, monkeypatch):
    """``levels``: a KIVI page's own key statistics (per-channel min and step) are its summaries. The
    bounds equal the loop over ``(k_min, k_min + levels * k_scale)``, which are exactly each channel's
    smallest and largest dequantized key, so no key of a page scores above its page's bound."""
    from sparse_kernels.kv_quant import decode_kivi_pages, encode_kivi_pages

    device = "cpu" if backend == "reference" else triton_device
    backend = _backend(backend, monkeypatch)
    gen = torch.Generator().manual_seed(bits)
    num_blocks, page, hkv, hq, d = 24, 16, 2, 8, 32
    keys = (torch.randn(num_blocks, page, hkv, d, generator=gen) * 3 + 1).bfloat16()
    values = torch.randn(num_blocks, page, hkv, d, generator=gen).bfloat16()
    k_codes, v_codes, k_scale, k_min, v_scale, v_min = encode_kivi_pages(keys, values, bits, page)
    deq, _ = decode_kivi_pages(k_codes, v_codes, k_scale, k_min, v_scale, v_min, bits, d)
    levels = 2**bits - 1
    top = k_min.float() + levels * k_scale.float()
    torch.testing.assert_close(deq.amin(1), k_min.float(), rtol=0, atol=0)  # code 0 is each channel's min
    torch.testing.assert_close(deq.amax(1), top, rtol=1e-6, atol=1e-6)  # and the top code its max
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [perm[:9], perm[9:10], perm[10:24]]
    q = torch.randn(3, hq, d, generator=gen).bfloat16()
    max_pages, sink, recent = 16, 1, 1
    start = torch.tensor([0, 9, 10], dtype=torch.int64)
    num_pages = torch.tensor([9, 1, 14], dtype=torch.int32)
    indices = torch.tensor(sum(tables, []), dtype=torch.int32)
    out = torch.empty(3, hkv, max_pages, device=device)
    args = (q, k_min, k_scale, indices, start, num_pages)
    page_bounds(*(a.to(device) for a in args), out, sink=sink, recent=recent, levels=levels, backend=backend)
    out = out.cpu()
    torch.testing.assert_close(out, _loop(q, k_min, top, tables, max_pages, sink, recent), rtol=1e-5, atol=1e-4)
    g = hq // hkv
    for b, table in enumerate(tables):
        for p, block in enumerate(table):
            for h in range(hkv):
                scores = q[b, h * g : (h + 1) * g].float() @ deq[block, :, h].T  # [g, page]
                assert scores.max() <= out[b, h, p] + 1e-4


def test_levels_need_float_statistics():
    q = torch.zeros(1, 2, 16)
    stats = torch.zeros(3, 1, 16, dtype=torch.int8)
    out = torch.empty(1, 1, 2)
    args = (q, stats, stats, torch.zeros(2, dtype=torch.int32), torch.zeros(1), torch.ones(1))
    with pytest.raises(ValueError, match="levels"):
        page_bounds(*args, out, scale=torch.ones(3, 1), levels=3)
    with pytest.raises(ValueError, match="levels"):
        page_bounds(q, stats.float(), stats.float(), *args[3:], out, levels=-1)


@pytest.mark.parametrize("backend", ["reference", "triton", TOGETHER])
@pytest.mark.parametrize("coded", [False, True])
def test_bfloat16_out_holds_the_float32_bounds_rounded_to_nearest(backend, coded, triton_device, monkeypatch):
    """A bfloat16 ``out`` (Quest's ranking) holds exactly the float32 bounds of the same call rounded to
    nearest, ties to even, infinities included, over model-dtype summaries and over int8 codes."""
    from sparse_kernels.summary_codes import encode_summary

    device = "cpu" if backend == "reference" else triton_device
    backend = _backend(backend, monkeypatch)
    gen = torch.Generator().manual_seed(9)
    num_blocks, hkv, hq, d = 30, 2, 8, 64
    a, b = (torch.randn(2, num_blocks, hkv, d, generator=gen) * 3).bfloat16()
    kmin, kmax = torch.minimum(a, b), torch.maximum(a, b)
    scale = None
    if coded:
        kmin, kmax, scale = encode_summary(kmin, kmax)
        scale = scale.to(device)
    indices = torch.randperm(num_blocks, generator=gen)[:29].to(torch.int32)
    start, num_pages = torch.tensor([0, 12, 13]), torch.tensor([12, 1, 16], dtype=torch.int32)
    q = torch.randn(3, hq, d, generator=gen).bfloat16()
    args = [t.to(device) for t in (q, kmin, kmax, indices, start, num_pages)]
    wide = torch.empty(3, hkv, 20, device=device)
    narrow = torch.empty(3, hkv, 20, dtype=torch.bfloat16, device=device)
    for out in (wide, narrow):
        page_bounds(*args, out, sink=1, recent=2, scale=scale, backend=backend)
    assert torch.equal(narrow, wide.bfloat16())
    assert (narrow[:, :, 0] == float("inf")).all() and (narrow[:, :, 16:] == float("-inf")).all()
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        page_bounds(*args, torch.empty(3, hkv, 20, dtype=torch.float16, device=device), scale=scale, backend=backend)
