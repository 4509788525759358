"""rope_qk: the reference against a complex-number rotation, Triton (with and without the per-head
q/k norm) against the reference, natively on CUDA else under Triton's interpreter.

bf16 rounds at up to five points per element (norm, weight, two products, their sum), so a few
elements may differ by a few last-bit steps (5e-2): the head norm sums squares in another order, and
the interpreter truncates fp32 -> bf16 casts where the GPU (and torch) round to nearest.
"""

from __future__ import annotations

import pytest
import torch

from sparse_kernels import rms_norm, rope_qk

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=5e-2, rtol=5e-2)}


def _table(head_dim, max_position=64, theta=10000.0):
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.arange(max_position).float()[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)  # [P, D]


def _qkv(tokens, num_q_heads, num_kv_heads, head_dim, dtype, seed=0):
    """q and k as strided views of one merged projection output, as the models produce them."""
    gen = torch.Generator().manual_seed(seed)
    merged = torch.randn(tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    q = merged[:, :q_size].view(tokens, num_q_heads, head_dim)
    k = merged[:, q_size : q_size + kv_size].view(tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    weights = [(1 + 0.1 * torch.randn(head_dim, generator=gen)).to(dtype) for _ in range(2)]
    return q, k, positions, weights


def test_reference_matches_complex_rotation():
    head_dim = 96
    q, k, positions, _ = _qkv(5, 4, 2, head_dim, torch.float32)
    table = _table(head_dim)
    got_q, got_k = rope_qk(q, k, positions, table, backend="reference")
    cos, sin = table[positions].chunk(2, dim=-1)
    rot = torch.complex(cos, sin)[:, None, :].to(torch.complex128)  # [T, 1, D/2]
    for x, got in ((q, got_q), (k, got_k)):
        z = torch.complex(x[..., : head_dim // 2].double(), x[..., head_dim // 2 :].double()) * rot
        torch.testing.assert_close(got.double(), torch.cat((z.real, z.imag), dim=-1), atol=1e-5, rtol=1e-5)


def test_reference_norm_then_rotate():
    q, k, positions, (qw, kw) = _qkv(3, 4, 2, 64, torch.float32)
    table = _table(64)
    got_q, got_k = rope_qk(q, k, positions, table, q_weight=qw, k_weight=kw, eps=1e-6, backend="reference")
    exp_q, exp_k = rope_qk(rms_norm(q, qw, 1e-6), rms_norm(k, kw, 1e-6), positions, table, backend="reference")
    torch.testing.assert_close(got_q, exp_q, atol=0, rtol=0)
    torch.testing.assert_close(got_k, exp_k, atol=0, rtol=0)


def _triton_and_reference(tokens, head_dim, heads, norm, dtype, device):
    """``rope_qk`` of one random step on the Triton backend (on the CPU) and the reference."""
    num_q_heads, num_kv_heads = heads
    q, k, positions, (qw, kw) = _qkv(tokens, num_q_heads, num_kv_heads, head_dim, dtype, seed=tokens)
    table = _table(head_dim)
    weights = dict(q_weight=qw, k_weight=kw) if norm else {}
    exp_q, exp_k = rope_qk(q, k, positions, table, eps=1e-6, backend="reference", **weights)
    dev = {name: w.to(device) for name, w in weights.items()}
    got_q, got_k = rope_qk(
        q.to(device), k.to(device), positions.to(device), table.to(device), eps=1e-6, backend="triton", **dev
    )
    assert got_q.is_contiguous() and got_k.is_contiguous() and got_q.dtype == dtype
    torch.testing.assert_close(got_q.cpu(), exp_q, **TOL[dtype])
    torch.testing.assert_close(got_k.cpu(), exp_k, **TOL[dtype])
    return got_q.cpu(), got_k.cpu()


@pytest.mark.parametrize("tokens", [1, 3, 17])
@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("heads", [(1, 1), (4, 1), (8, 2)])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_reference(tokens, head_dim, heads, norm, dtype, triton_device):
    _triton_and_reference(tokens, head_dim, heads, norm, dtype, triton_device)


@pytest.mark.parametrize("tokens", [3, 70])  # either side of TILE_MIN_TOKENS; 70 ends in a partial tile
@pytest.mark.parametrize("head_dim", [16, 96])  # 96: 48 columns of a 64-column tile
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_token_tiles(tokens, head_dim, norm, dtype, triton_device, monkeypatch):
    """The launch the step's length picks (one token a program below the threshold, tiles of tokens from
    it) matches the reference, and the other launch writes the same bits."""
    from sparse_kernels._triton import rope as rope_triton

    chosen = _triton_and_reference(tokens, head_dim, (2, 1), norm, dtype, triton_device)
    if tokens >= rope_triton.TILE_MIN_TOKENS and not (norm and dtype == torch.bfloat16 and head_dim == 96):
        return  # 70 tokens one a program is slow interpreted: compared in one case (and in test_rope_store)
    tiled = tokens >= rope_triton.TILE_MIN_TOKENS
    monkeypatch.setattr(rope_triton, "TILE_MIN_TOKENS", 10**9 if tiled else 1)
    assert rope_triton._token_tile(tokens, head_dim // 2)[0] == (1 if tiled else rope_triton.TILE_TOKENS)
    other = _triton_and_reference(tokens, head_dim, (2, 1), norm, dtype, triton_device)
    for got, exp in zip(chosen, other, strict=True):
        torch.testing.assert_close(got, exp, atol=0, rtol=0)


def test_token_tile_choice():
    """Decode-sized steps keep the one-token launch (and its warps); longer steps stack it 8 times."""
    from sparse_kernels._triton.rope import TILE_MIN_TOKENS, _token_tile

    assert TILE_MIN_TOKENS == 64
    for tokens in (1, 5, 32, 63):
        assert _token_tile(tokens, 32) == _token_tile(tokens, 64) == (1, 1) and _token_tile(tokens, 128) == (1, 2)
    for tokens in (64, 2048, 8192):
        assert _token_tile(tokens, 32) == _token_tile(tokens, 64) == (8, 8) and _token_tile(tokens, 128) == (8, 16)


def test_triton_int32_positions(triton_device):
    q, k, positions, _ = _qkv(3, 4, 2, 64, torch.float32)
    table = _table(64)
    exp_q, exp_k = rope_qk(q, k, positions, table, backend="reference")
    got_q, got_k = rope_qk(
        q.to(triton_device),
        k.to(triton_device),
        positions.to(torch.int32).to(triton_device),
        table.to(triton_device),
        backend="triton",
    )
    torch.testing.assert_close(got_q.cpu(), exp_q, **TOL[torch.float32])
    torch.testing.assert_close(got_k.cpu(), exp_k, **TOL[torch.float32])


def test_rejects_bad_inputs():
    q, k, positions, (qw, _) = _qkv(3, 4, 2, 64, torch.float32)
    table = _table(64)
    with pytest.raises(ValueError, match="both"):
        rope_qk(q, k, positions, table, q_weight=qw)
    with pytest.raises(ValueError, match="cos_sin"):
        rope_qk(q, k, positions, table[:, :32])
    with pytest.raises(ValueError, match="positions"):
        rope_qk(q, k, positions[:2], table)
