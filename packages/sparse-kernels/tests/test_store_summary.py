"""store_kv(summary=...): the store and the decode step's block-summary update in one call (on Triton, one
launch) equal store_kv then update_block_summaries on the reference backend, bit for bit.

The Triton backend runs natively on CUDA where present, else on CPU under Triton's interpreter (every
interpreted launch is also compiled for sm_90 by the suite's autouse ``compiled_for_hopper``).
"""

from __future__ import annotations

import pytest
import torch

import sparse_kernels._triton.summary as triton_summary
from sparse_kernels import store_kv, update_block_summaries

NUM_BLOCKS = 8


def _slots(bs: int) -> list[int]:
    """Seven rows: a padding row first (its key NaN), fresh blocks (offset 0), a block's last offset, a middle
    one, offset 1, padding between; no two valid slots share a block."""
    return [-1, 3 * bs + 0, 5 * bs + bs - 1, -1, 1 * bs + bs // 2, 6 * bs + 1, 0 * bs + 0]


def _case(heads: int, head_dim: int, cache_dtype, summary_dtype, codes: bool, seed: int = 0, block_size: int = 4):
    """A pool with random prior contents, random prior summaries, the step's rows and the copy arguments."""
    gen = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, block_size, heads, head_dim)
    # Spread per head so each head's scale differs; earlier tokens reach further than the new keys, so a
    # summary that forgot them would differ.
    spread = torch.tensor([3.0, 0.5, 1.5, 2.0][:heads] + [1.0] * max(0, heads - 4))[:, None]
    k_cache = (torch.randn(shape, generator=gen) * spread * 2).to(cache_dtype)
    v_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    slots = _slots(block_size)
    n = len(slots)
    key = (torch.randn(n, heads, head_dim, generator=gen) * spread).to(cache_dtype)
    value = torch.randn(n, heads, head_dim, generator=gen).to(cache_dtype)
    key[[i for i, s in enumerate(slots) if s < 0]] = float("nan")  # padding rows must reach nothing
    if codes:
        kmin = torch.randint(-127, 128, (NUM_BLOCKS, heads, head_dim), generator=gen, dtype=torch.int8)
        kmax = torch.randint(-127, 128, (NUM_BLOCKS, heads, head_dim), generator=gen, dtype=torch.int8)
        scale = torch.rand(NUM_BLOCKS, heads, generator=gen) + 0.01
    else:
        kmin = torch.randn(NUM_BLOCKS, heads, head_dim, generator=gen).to(summary_dtype) - 1
        kmax = torch.randn(NUM_BLOCKS, heads, head_dim, generator=gen).to(summary_dtype) + 1
        scale = None
    merged = torch.randn(n, 3, 4, head_dim, generator=gen).to(cache_dtype)  # [T, 3 parts, 4 q heads, D]
    into = torch.randn(9, 4, head_dim, generator=gen).to(cache_dtype)
    index = torch.tensor([6, 0, 8, 3, 1, 2, 5, 7], dtype=torch.int64)
    return [k_cache, v_cache, key, value, kmin, kmax, scale, merged, into, index]


def _run(case, device, backend, copy: bool, fused: bool):
    k_cache, v_cache, key, value, kmin, kmax, scale, merged, into, index = (
        None if t is None else t.clone().to(device) for t in case
    )
    slots = torch.tensor(_slots(k_cache.shape[1]), dtype=torch.int32, device=device)
    extra = {"copy_rows": merged[:4, 1], "copy_into": into, "copy_index": index} if copy else {}
    if fused:
        store_kv(key, value, k_cache, v_cache, slots, summary=(kmin, kmax, scale), backend=backend, **extra)
    else:
        store_kv(key, value, k_cache, v_cache, slots, backend=backend, **extra)
        update_block_summaries(k_cache, slots, kmin, kmax, scale=scale, backend=backend)
    return [t.cpu() for t in (k_cache, v_cache, kmin, kmax, into) + ((scale,) if scale is not None else ())]


def _assert_same(got, expected):
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == e.dtype and torch.equal(g.view(torch.uint8), e.view(torch.uint8))  # bit for bit


@pytest.fixture
def separate_launches(monkeypatch):
    """Counts launches of the separate int8 summary kernel (``update_block_summaries``' Triton path)."""
    calls = []
    original = triton_summary.block_summary_triton

    def spy(*args, **kwargs):
        calls.append(kwargs.get("from_slots"))
        return original(*args, **kwargs)

    monkeypatch.setattr(triton_summary, "block_summary_triton", spy)
    return calls


@pytest.mark.parametrize("copy", [False, True])
@pytest.mark.parametrize(
    ("cache_dtype", "summary_dtype", "codes"),
    [
        (torch.bfloat16, torch.bfloat16, False),
        (torch.bfloat16, torch.float32, False),
        (torch.float32, torch.float32, False),
        (torch.bfloat16, torch.int8, True),
        (torch.float32, torch.int8, True),
    ],
)
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_fused_summary_equals_store_then_update(
    backend, cache_dtype, summary_dtype, codes, copy, triton_device, separate_launches
):
    case = _case(2, 16, cache_dtype, summary_dtype, codes)
    expected = _run(case, "cpu", "reference", copy, fused=False)
    got = _run(case, triton_device if backend == "triton" else "cpu", backend, copy, fused=True)
    _assert_same(got, expected)
    if backend == "triton":
        assert separate_launches == []  # one launch: the summary kernel did not run on its own


@pytest.mark.parametrize(("heads", "block_size"), [(3, 4), (2, 64)])
@pytest.mark.parametrize("codes", [False, True])
def test_unfused_codes_fall_back(codes, heads, block_size, triton_device, separate_launches):
    """3 KV heads (no [heads, head_dim] view of a row) or 64-token blocks (earlier keys past one register
    tile): int8 codes fall back to the separate summary kernel after the store; float summaries still fuse
    (3 heads: over a masked row). Either way the result equals the reference."""
    case = _case(heads, 16, torch.bfloat16, torch.bfloat16, codes, seed=1, block_size=block_size)
    expected = _run(case, "cpu", "reference", True, fused=False)
    got = _run(case, triton_device, "triton", True, fused=True)
    _assert_same(got, expected)
    assert separate_launches == ([True] if codes else [])


def test_earlier_tokens_matter():
    """The codes' case is sensitive to the block's earlier keys: changing one (not the new slot) changes
    the expected summary, so a kernel that skipped their load would fail the test above."""
    case = _case(2, 16, torch.bfloat16, torch.int8, True)
    expected = _run(case, "cpu", "reference", False, fused=False)
    case[0][5, 0, 0] = 100.0  # block 5's token 0; the step writes offset 3
    changed = _run(case, "cpu", "reference", False, fused=False)
    assert not torch.equal(expected[2][5], changed[2][5]) and not torch.equal(expected[5][5], changed[5][5])


def test_bad_summary_tensors_raise():
    k_cache, v_cache = torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8)
    key = value = torch.zeros(2, 2, 8)
    slots = torch.tensor([0, 5], dtype=torch.int32)
    kmin, kmax = torch.zeros(4, 2, 8), torch.zeros(4, 2, 8)
    codes, scale = torch.zeros(4, 2, 8, dtype=torch.int8), torch.ones(4, 2)
    bad = [
        ((kmin[:3], kmax, None), "kmin must be"),
        ((kmin, kmax.transpose(0, 1).contiguous(), None), "kmax must be"),
        ((kmin, kmax, scale), "int8 summary codes"),  # float summaries with a scale
        ((codes, codes, None), "int8 summary codes"),  # codes without one
        ((codes, codes, scale.double()), "scale must be"),
        ((codes, codes, scale[:, :1]), "scale must be"),
    ]
    for summary, match in bad:
        for backend in ("reference", "triton"):
            with pytest.raises(ValueError, match=match):
                store_kv(key, value, k_cache, v_cache, slots, summary=summary, backend=backend)
    assert not k_cache.any()  # rejected before anything was stored
