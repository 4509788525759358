"""linear_epilogue: the small-M kernel's residual / norm / gate epilogues against the plain formulas
(natively on CUDA, else under Triton's interpreter), and the fused chain against the unfused one.

Tolerances: bf16 inputs are exact in fp32, so every kernel output is one bf16 rounding of an fp32 value
computed from the kernel's own inputs (rtol 2**-7: the interpreter's fp32 -> bf16 cast may truncate).
The sums of squares are fp32 sums of the kernel's own rounded output, in another order (1e-5).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sparse_kernels import rms_norm, silu_and_mul
from sparse_kernels.linear_epilogue import NormedHidden, add_norm_inputs, fuses, linear_add_norm, linear_normed

BF16_ROUNDING = {"atol": 1e-6, "rtol": 2**-7}


def _tensors(m, k, n, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    residual = torch.randn(m, n, generator=g).to(dtype)
    g_norm = (1 + 0.2 * torch.randn(n, generator=g)).to(dtype)
    return x, w, b, residual, g_norm


@pytest.mark.parametrize(("m", "k", "n"), [(1, 96, 64), (3, 257, 100), (16, 64, 40)])  # tails; 1 row: 32-wide tiles
@pytest.mark.parametrize("bias", [False, True])
def test_add_norm_writes_the_sum_in_place_and_the_next_norms_inputs(m, k, n, bias, triton_device):
    x, w, b, residual, g_norm = _tensors(m, k, n)
    b = b if bias else None
    dev = lambda t: None if t is None else t.to(triton_device)  # noqa: E731
    res = dev(residual).clone()
    out = linear_add_norm(dev(x), dev(w), dev(b), res, dev(g_norm), 1e-6, backend="triton")
    assert out.hidden.data_ptr() == res.data_ptr()  # the residual stream, updated in place
    want = F.linear(x.float(), w.float(), None if b is None else b.float()) + residual.float()
    hidden = out.hidden.cpu().float()
    torch.testing.assert_close(hidden, want, **BF16_ROUNDING)
    torch.testing.assert_close(out.scaled.cpu().float(), hidden * g_norm.float(), **BF16_ROUNDING)
    assert out.sumsq.dtype == torch.float32 and out.sumsq.shape[1] == m and out.sumsq.shape[0] > 1
    torch.testing.assert_close(out.sumsq.cpu().sum(0), (hidden * hidden).sum(-1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("m", "k", "n"), [(1, 64, 96), (5, 100, 130), (16, 40, 64)])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_normed_applies_the_row_scale_and_the_gate(m, k, n, gated, bias, triton_device):
    x, _, _, residual, g_norm = _tensors(m, 8, k, seed=1)
    _, w, b, _, _ = _tensors(m, k, n, seed=2)
    b = b if bias else None
    # The writer's partials, three column ranges of the hidden state (as a kernel with 3 tiles leaves them).
    h = residual.float()
    sumsq = torch.stack([(h[:, s] ** 2).sum(-1) for s in (slice(0, 3), slice(3, 10), slice(10, None))])
    normed = NormedHidden(residual, (h * g_norm.float()).to(torch.bfloat16), sumsq, 1e-5)
    dev = lambda t: None if t is None else t.to(triton_device)  # noqa: E731
    on_dev = NormedHidden(dev(normed.hidden), dev(normed.scaled), dev(normed.sumsq), normed.eps)
    got = linear_normed(on_dev, dev(w), dev(b), gated=gated, backend="triton").cpu().float()
    scale = torch.rsqrt((h * h).mean(-1) + 1e-5)
    y = F.linear(normed.scaled.float(), w.float()) * scale[:, None] + (0 if b is None else b.float())
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    assert got.shape == y.shape
    torch.testing.assert_close(got, y, atol=1e-5, rtol=2**-7)
    torch.testing.assert_close(
        linear_normed(normed, w, b, gated=gated, backend="reference").float(), y, atol=1e-6, rtol=2**-8
    )


def test_the_fused_chain_equals_the_unfused_one(triton_device):
    """One block as a decoder runs it: o + residual -> norm -> gate/up -> SiLU * up -> down + residual ->
    next norm, fused against separate projections, add + norm and SiLU * mul (bf16 rounding apart)."""
    dim, inter, m = 64, 96, 4
    g = torch.Generator().manual_seed(3)
    w = lambda *s: (torch.randn(*s, generator=g) / s[-1] ** 0.5).to(torch.bfloat16)  # noqa: E731
    o, h = torch.randn(m, dim, generator=g).bfloat16(), torch.randn(m, dim, generator=g).bfloat16()
    w_o, w_gu, w_down = w(dim, dim), w(2 * inter, dim), w(dim, inter)
    g1, g2 = (1 + 0.2 * torch.randn(dim, generator=g)).bfloat16(), (1 + 0.2 * torch.randn(dim, generator=g)).bfloat16()

    # Unfused, the reference kernels.
    h1 = (F.linear(o, w_o).float() + h.float()).bfloat16()
    act = silu_and_mul(F.linear(rms_norm(h1, g1, 1e-6), w_gu), backend="reference")
    h2 = (F.linear(act, w_down).float() + h1.float()).bfloat16()
    want = rms_norm(h2, g2, 1e-6, backend="reference").float()

    dev = lambda t: t.to(triton_device)  # noqa: E731
    n1 = linear_add_norm(dev(o), dev(w_o), None, dev(h).clone(), dev(g1), 1e-6, backend="triton")
    act_fused = linear_normed(n1, dev(w_gu), gated=True, backend="triton")
    n2 = linear_add_norm(act_fused, dev(w_down), None, n1.hidden, dev(g2), 1e-6, backend="triton")
    torch.testing.assert_close(n2.normed().cpu().float(), want, atol=0.05, rtol=0.02)
    torch.testing.assert_close(n2.hidden.cpu().float(), h2.float(), atol=0.05, rtol=0.02)


def test_inputs_of_the_first_layer_and_what_fuses(triton_device):
    """The embedding enters the first layer through ``rms_norm`` (no sums pending): the projection then runs
    without a row scale, gated or not."""
    x = torch.randn(3, 32).bfloat16()
    g_norm = (1 + 0.1 * torch.randn(32)).bfloat16()
    first = add_norm_inputs(x, g_norm, 1e-6)
    assert first.sumsq is None and first.hidden is x
    assert torch.equal(first.normed(), rms_norm(x, g_norm, 1e-6))
    w = (torch.randn(48, 32) / 32**0.5).bfloat16()
    dev = NormedHidden(first.hidden.to(triton_device), first.scaled.to(triton_device), None, first.eps)
    for gated in (False, True):
        y = F.linear(first.scaled.float(), w.float())
        if gated:
            y = F.silu(y[:, :24]) * y[:, 24:]
        got = linear_normed(dev, w.to(triton_device), gated=gated, backend="triton")
        torch.testing.assert_close(got.cpu().float(), y, atol=1e-5, rtol=2**-7)
    assert not fuses(x)  # CPU: the reference backend
    assert fuses(x, backend="triton") and not fuses(x.float(), backend="triton")
    assert not fuses(torch.randn(17, 32).bfloat16(), backend="triton")  # past the small-M kernel's rows


def test_bad_inputs_are_named():
    x, w, b, residual, g_norm = _tensors(2, 16, 8)
    with pytest.raises(ValueError, match="residual"):
        linear_add_norm(x, w, b, residual[:1], g_norm, 1e-6)
    with pytest.raises(ValueError, match="norm_weight"):
        linear_add_norm(x, w, b, residual, g_norm[:3], 1e-6)
    normed = add_norm_inputs(residual, g_norm, 1e-6)
    with pytest.raises(ValueError, match="gated"):
        linear_normed(normed, torch.randn(5, 8).bfloat16(), gated=True)
    with pytest.raises(ValueError, match="sumsq"):
        linear_normed(normed._replace(sumsq=torch.ones(1, 2, dtype=torch.float64)), torch.randn(4, 8).bfloat16())
