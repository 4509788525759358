"""rms_norm and fused_add_rms_norm: the reference against an fp64 formula, Triton against the reference.

Triton runs natively on CUDA where present, else on CPU under Triton's interpreter. fp32 agrees to
~1e-6. bf16 agrees to one rounding step (2e-2): the kernel sums squares in another order, and the
interpreter truncates fp32 -> bf16 casts where the GPU (and torch) round to nearest.
"""

from __future__ import annotations

import pytest
import torch

from sparse_kernels import fused_add_rms_norm, rms_norm

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _inputs(rows, hidden, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(rows, hidden, generator=gen)).to(dtype)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    return x, residual, weight


@pytest.mark.parametrize("hidden", [64, 96, 128])
def test_reference_matches_fp64_formula(hidden):
    x, residual, weight = _inputs(5, hidden, torch.float32)
    x64 = x.double()
    expected = x64 / (x64.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * weight.double()
    torch.testing.assert_close(rms_norm(x, weight, 1e-6, backend="reference").double(), expected)
    out, h = fused_add_rms_norm(x, residual, weight, 1e-6, backend="reference")
    torch.testing.assert_close(h, x + residual, atol=0, rtol=0)
    torch.testing.assert_close(out, rms_norm(x + residual, weight, 1e-6, backend="reference"), atol=0, rtol=0)


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("hidden", [64, 96, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_reference(rows, hidden, dtype, triton_device):
    x, residual, weight = _inputs(rows, hidden, dtype)
    expected = rms_norm(x, weight, 1e-5, backend="reference")
    exp_out, exp_h = fused_add_rms_norm(x, residual, weight, 1e-5, backend="reference")
    x, residual, weight = x.to(triton_device), residual.to(triton_device), weight.to(triton_device)
    got = rms_norm(x, weight, 1e-5, backend="triton")
    out, h = fused_add_rms_norm(x, residual, weight, 1e-5, backend="triton")
    assert got.dtype == out.dtype == h.dtype == dtype
    torch.testing.assert_close(got.cpu(), expected, **TOL[dtype])
    torch.testing.assert_close(out.cpu(), exp_out, **TOL[dtype])
    torch.testing.assert_close(h.cpu(), exp_h, **TOL[dtype])


def test_triton_strided_rows_and_leading_dims(triton_device):
    """A [T, H, D] head view with a row stride (a slice of a merged projection) normalises over D."""
    gen = torch.Generator().manual_seed(1)
    merged = torch.randn(3, 4 * 64 + 32, generator=gen)
    heads = merged[:, :256].view(3, 4, 64)  # token stride 288, not 256
    weight = torch.randn(64, generator=gen)
    expected = rms_norm(heads, weight, 1e-6, backend="reference")
    got = rms_norm(heads.to(triton_device), weight.to(triton_device), 1e-6, backend="triton")
    torch.testing.assert_close(got.cpu(), expected, **TOL[torch.float32])


def test_mixed_weight_dtype_promotes_like_torch(triton_device):
    x, _, weight = _inputs(3, 64, torch.bfloat16)
    weight = weight.float()
    expected = rms_norm(x, weight, 1e-6, backend="reference")
    got = rms_norm(x.to(triton_device), weight.to(triton_device), 1e-6, backend="triton")
    assert got.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), expected, **TOL[torch.bfloat16])


def test_rejects_mismatched_shapes():
    x, residual, weight = _inputs(3, 64, torch.float32)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, weight[:32], 1e-6)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm(x, residual.to(torch.bfloat16), weight, 1e-6)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm(x, residual[:2], weight, 1e-6)
