"""ContiguousCausalAttention against torch's SDPA, one sequence at a time."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sparse_models import ContiguousCausalAttention


def _reference(q, k, v, scale, window=None):
    """One sequence: q [L, Hq, D], k/v [L, Hkv, D] through SDPA with an explicit mask."""
    length = q.shape[0]
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    mask = (j <= i) & (j > i - window) if window else j <= i
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize("num_kv_heads", [1, 2, 6])
@pytest.mark.parametrize("window", [None, 1, 4])
def test_matches_sdpa_per_sequence(num_kv_heads, window):
    lens = [7, 1, 0, 12]
    bounds = [0, *torch.tensor(lens).cumsum(0).tolist()]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lens), 6, 8, generator=gen)
    k = torch.randn(sum(lens), num_kv_heads, 8, generator=gen)
    v = torch.randn(sum(lens), num_kv_heads, 8, generator=gen)
    out = ContiguousCausalAttention(torch.tensor(bounds), sliding_window=window).forward(0, q, k, v, 0.3)
    for s, e in zip(bounds, bounds[1:], strict=False):
        if s < e:
            torch.testing.assert_close(out[s:e], _reference(q[s:e], k[s:e], v[s:e], 0.3, window))


def test_per_layer_windows_and_dtype():
    q, k, v = (torch.randn(10, 2, 4, dtype=torch.bfloat16) for _ in range(3))
    attn = ContiguousCausalAttention([0, 10], sliding_window=(None, 3))
    full, windowed = attn.forward(0, q, k, v, 0.5), attn.forward(1, q, k, v, 0.5)
    assert full.dtype == torch.bfloat16
    torch.testing.assert_close(full, _reference(q, k, v, 0.5), atol=2e-2, rtol=0)
    torch.testing.assert_close(windowed, _reference(q, k, v, 0.5, 3), atol=2e-2, rtol=0)


def test_rejects_bad_bounds():
    with pytest.raises(ValueError, match="cu_seqlens"):
        ContiguousCausalAttention([0, 5, 3])
    q = torch.randn(4, 2, 4)
    with pytest.raises(ValueError, match="tokens"):
        ContiguousCausalAttention([0, 5]).forward(0, q, q, q, 1.0)
