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


@pytest.mark.parametrize("target_programs", [2048, 8])  # many one-step chunks per row / one long loop per row
@pytest.mark.parametrize("head_dim", [64, 96])  # 96: the masked load along d
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


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_statistics_bound_every_page_of_dequantized_keys(backend, bits, triton_device):
    """``levels``: a KIVI page's own key statistics (per-channel min and step) are its summaries. The
    bounds equal the loop over ``(k_min, k_min + levels * k_scale)``, which are exactly each channel's
    smallest and largest dequantized key, so no key of a page scores above its page's bound."""
    from sparse_kernels.kv_quant import decode_kivi_pages, encode_kivi_pages

    device = triton_device if backend == "triton" else "cpu"
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


def _plain_query_codes(q: list[float]) -> tuple[list[int], float]:
    """One head's int8 code and scale, element by element in float32 as the kernel does it."""
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    amax = max(abs(v) for v in q)
    scale = (f32(amax) / 127).item() if amax > 0 else 1.0
    return [max(-127, min(127, int(torch.floor(f32(v) / f32(scale) + 0.5).item()))) for v in q], scale


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_query_codes_bound_equals_the_integer_loop(out_dtype, triton_device):
    """``query_codes``: each query head as int8 codes (rounded to nearest, scale max|q| / 127) against int8
    summary codes. Triton equals the reference exactly (integer sums, then the page's scale, then the
    head's), both equal a per-page loop over the integers written here, and the bound stays within its
    stated distance of the float query's; a bfloat16 ``out`` holds the same bounds rounded to nearest."""
    from sparse_kernels.summary_codes import encode_summary

    gen = torch.Generator().manual_seed(5)
    num_blocks, hkv, hq, d = 30, 2, 8, 64
    a, b = torch.randn(2, num_blocks, hkv, d, generator=gen).bfloat16()
    kmin, kmax, scale = encode_summary(torch.minimum(a, b), torch.maximum(a, b))
    q = torch.randn(3, hq, d, generator=gen).bfloat16()
    q[1, :4] = 0  # an all-zero query group: scale 1, codes 0, bounds 0
    tables = [list(range(0, 12)), [12], list(range(13, 30))]
    indices = torch.tensor(sum(tables, []), dtype=torch.int32)
    start, num_pages = torch.tensor([0, 12, 13]), torch.tensor([12, 1, 17], dtype=torch.int32)
    args = (q, kmin, kmax, indices, start, num_pages)
    outs = {}
    for backend, device in (("reference", "cpu"), ("triton", triton_device)):
        out = torch.empty(3, hkv, 20, dtype=out_dtype, device=device)
        page_bounds(*(t.to(device) for t in args), out, sink=1, recent=1, scale=scale.to(device), query_codes=True,
                    backend=backend)  # fmt: skip
        outs[backend] = out.cpu()
    assert torch.equal(outs["triton"], outs["reference"])
    float_query = torch.empty(3, hkv, 20)
    page_bounds(*args, float_query, sink=1, recent=1, scale=scale, backend="reference")
    g = hq // hkv
    for bi, table in enumerate(tables):
        for h in range(hkv):
            coded = [_plain_query_codes(q[bi, hh].float().tolist()) for hh in range(h * g, (h + 1) * g)]
            for p, block in enumerate(table[1:-1], start=1):
                lo, hi = kmin[block, h].tolist(), kmax[block, h].tolist()
                per_head = []
                for codes, q_scale in coded:
                    total = sum(max(c * x, c * y) for c, x, y in zip(codes, hi, lo, strict=True))
                    per_head.append(torch.tensor(float(total)) * scale[block, h] * q_scale)
                want = max(per_head).to(out_dtype)
                assert outs["reference"][bi, h, p] == want
                # each head's coded sum is off by at most scale * q_scale / 2 * sum_d max(|kmin_d|, |kmax_d|)
                codes_mass = sum(max(abs(x), abs(y)) for x, y in zip(lo, hi, strict=True))
                slack = float(scale[block, h]) * max(s for _, s in coded) / 2 * codes_mass
                exact = float(float_query[bi, h, p])
                rounding = 2**-8 * abs(exact) if out_dtype == torch.bfloat16 else 0.0
                assert abs(float(outs["reference"][bi, h, p]) - exact) <= 1.01 * slack + rounding
    assert (outs["reference"][1, 0, :1] == float("inf")).all() and (outs["reference"][:, :, 17:] == float("-inf")).all()


def test_query_codes_need_summary_codes():
    q = torch.randn(1, 4, 16)
    kmin = torch.zeros(3, 2, 16)
    with pytest.raises(ValueError, match="query_codes"):
        table = torch.zeros(1, dtype=torch.int32)
        page_bounds(q, kmin, kmin, table, torch.zeros(1), torch.ones(1), torch.empty(1, 2, 1), query_codes=True)
