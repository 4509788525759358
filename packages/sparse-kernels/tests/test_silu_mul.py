"""silu_and_mul: the reference against its formula, Triton against the reference (natively on CUDA,
else under Triton's interpreter; bf16 within one rounding step, see test_rms_norm)."""

from __future__ import annotations

import pytest
import torch

from sparse_kernels import silu_and_mul

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def test_reference_matches_formula():
    x = torch.randn(3, 2 * 96, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    gate, up = x[:, :96], x[:, 96:]
    torch.testing.assert_close(silu_and_mul(x, backend="reference"), gate * torch.sigmoid(gate) * up)


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("inter", [64, 96, 128, 1500])  # 1500: several column blocks, the last partial
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_reference(rows, inter, dtype, triton_device):
    x = (3 * torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(rows))).to(dtype)
    expected = silu_and_mul(x, backend="reference")
    got = silu_and_mul(x.to(triton_device), backend="triton")
    assert got.shape == (rows, inter) and got.dtype == dtype
    torch.testing.assert_close(got.cpu(), expected, **TOL[dtype])


def test_triton_strided_rows(triton_device):
    x = torch.randn(5, 2 * 64 + 8, generator=torch.Generator().manual_seed(2))[:, : 2 * 64]
    expected = silu_and_mul(x, backend="reference")
    torch.testing.assert_close(silu_and_mul(x.to(triton_device), backend="triton").cpu(), expected, **TOL[x.dtype])


def test_rejects_odd_width():
    with pytest.raises(ValueError, match="2 \\* I"):
        silu_and_mul(torch.zeros(2, 7))
