"""The oracle itself, checked against torch SDPA with an explicit end-aligned causal mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sparse_kernels import causal_attention


def _sdpa(q, k, v, scale, causal):
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))  # [Hq, Tk, D]
    num_q, num_k = q.shape[0], k.shape[1]
    mask = None
    if causal:  # SDPA's is_causal aligns top-left; our queries are the last Tq positions
        mask = torch.arange(num_k)[None, :] <= torch.arange(num_k - num_q, num_k)[:, None]
    return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale).transpose(0, 1)


@pytest.mark.parametrize(("num_q", "num_k"), [(1, 1), (1, 97), (13, 97), (97, 97)])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_matches_sdpa(num_q, num_k, group, causal):
    gen = torch.Generator().manual_seed(num_q * 1000 + num_k)
    q = torch.randn(num_q, 2 * group, 32, generator=gen, dtype=torch.float64)
    k = torch.randn(num_k, 2, 32, generator=gen, dtype=torch.float64)
    v = torch.randn(num_k, 2, 32, generator=gen, dtype=torch.float64)
    out = causal_attention(q, k, v, causal=causal)
    assert out.dtype == torch.float64  # output follows q's dtype
    torch.testing.assert_close(out, _sdpa(q, k, v, 32**-0.5, causal), atol=1e-5, rtol=1e-5)


def test_last_query_sees_everything_first_key_only_for_first_position():
    q = torch.randn(3, 1, 4)
    k, v = torch.randn(3, 1, 4), torch.randn(3, 1, 4)
    out = causal_attention(q, k, v)
    torch.testing.assert_close(out[0], v[0])  # position 0 sees only key 0
    torch.testing.assert_close(out[2], causal_attention(q[2:], k, v)[0])


def test_rejects_bad_shapes():
    with pytest.raises(ValueError, match="Tq <= Tk"):
        causal_attention(torch.randn(3, 2, 4), torch.randn(2, 2, 4), torch.randn(2, 2, 4))
    with pytest.raises(ValueError, match="incompatible"):
        causal_attention(torch.randn(1, 3, 4), torch.randn(2, 2, 4), torch.randn(2, 2, 4))
    with pytest.raises(ValueError, match="expected q"):
        causal_attention(torch.randn(1, 2, 4), torch.randn(2, 2, 4), torch.randn(3, 2, 4))
