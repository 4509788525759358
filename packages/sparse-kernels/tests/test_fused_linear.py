"""gated_linear, residual_linear and norm_linear: the small-M kernel with SiLU * up, the residual add and
RMSNorm inside it, against their unfused compositions (natively on CUDA, else under Triton's interpreter).

Against the same kernels unfused (silu_and_mul then linear, linear then an add) the fused launches are
exact on the GPU: the input tiles are rounded at the same places, and the dot runs the same config (the
interpreter's casts may round toward zero where torch's add rounds to nearest: one bf16 ulp there). norm_linear sums
the row's squares in another order (per column tile of the writer, then the tiles) than rms_norm, so it
agrees with rms_norm then linear to a bf16 rounding of the normalised input, not bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from sparse_kernels import gated_linear, linear, norm_linear, residual_linear, rms_norm, silu_and_mul
from sparse_kernels._triton.linear import small_m_linear_triton

FMA = {"USE_DOT": False, "BLOCK_N": 8, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2}
DOT = {"USE_DOT": True, "BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2}
CONFIGS = {"fma": FMA, "dot": DOT, "dot_split3": {**DOT, "SPLIT_K": 3}}


def _same_rounding(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal on the GPU; within one bf16 ulp interpreted (the interpreter's fp32 -> bf16 cast may round toward
    zero where torch's rounds to nearest)."""
    if got.device.type == "cuda":
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got.float(), expected.float(), atol=1e-6, rtol=2**-7)


def _tensors(device, m, n, k, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(device)
    return g, x, w


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize(("m", "n", "k"), [(1, 24, 96), (5, 40, 160), (3, 17, 100)])
def test_gated_equals_silu_and_mul_then_linear(config, m, n, k, triton_device):
    g, _, w = _tensors(triton_device, m, n, k)
    x = torch.randn(m, 2 * k, generator=g).to(torch.bfloat16).to(triton_device)
    fused = small_m_linear_triton(x, w, None, config, gated=True)
    unfused = small_m_linear_triton(silu_and_mul(x, backend="triton"), w, None, config)
    assert torch.equal(fused, unfused)
    reference = torch.nn.functional.linear(silu_and_mul(x.cpu(), backend="reference").float(), w.cpu().float())
    torch.testing.assert_close(fused.cpu().float(), reference, atol=1e-2, rtol=2**-6)


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize(("m", "n", "k"), [(1, 24, 96), (5, 40, 160), (3, 17, 100)])
@pytest.mark.parametrize("bias", [False, True])
def test_residual_adds_after_rounding_and_leaves_each_tiles_squares(config, m, n, k, bias, triton_device):
    g, x, w = _tensors(triton_device, m, n, k)
    b = torch.randn(n, generator=g).to(torch.bfloat16).to(triton_device) if bias else None
    residual = torch.randn(m, n, generator=g).to(torch.bfloat16).to(triton_device)
    h, squares = small_m_linear_triton(x, w, b, config, residual=residual)
    _same_rounding(h, small_m_linear_triton(x, w, b, config) + residual)  # two roundings, as two ops
    tiles = -(-n // config["BLOCK_N"])
    assert squares.shape == (m, tiles) and squares.dtype == torch.float32
    hf = h.float().cpu()
    for t in range(tiles):
        cols = hf[:, t * config["BLOCK_N"] : (t + 1) * config["BLOCK_N"]]
        torch.testing.assert_close(squares[:, t].cpu(), (cols * cols).sum(1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize(("m", "k", "n"), [(1, 96, 24), (5, 160, 40), (3, 100, 17)])
def test_norm_from_the_writers_squares_equals_rms_norm_then_linear(config, m, k, n, triton_device):
    # The writer: a residual_linear of width k (its own column tiles); the reader normalises h as it reads it.
    g, x, w_in = _tensors(triton_device, m, k, 64, seed=1)
    residual = torch.randn(m, k, generator=g).to(torch.bfloat16).to(triton_device)
    h, squares = small_m_linear_triton(x, w_in, None, config, residual=residual)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16).to(triton_device)
    norm_w = (1 + 0.1 * torch.randn(k, generator=g)).to(torch.bfloat16).to(triton_device)
    fused = small_m_linear_triton(h, w, None, config, norm=(squares, norm_w, 1e-6))
    normed = rms_norm(h.cpu(), norm_w.cpu(), 1e-6, backend="reference")
    expected = torch.nn.functional.linear(normed.float(), w.cpu().float())
    # One bf16 rounding of the normalised input may differ (the statistic's summation order), then the
    # product's own rounding.
    torch.testing.assert_close(fused.cpu().float(), expected, atol=2e-2, rtol=2**-6)


def test_public_entry_points_compose_a_decoder_block(triton_device):
    # down (gated) + residual -> norm -> gate/up, as a decoder block chains them; against the plain ops.
    g = torch.Generator().manual_seed(3)
    bf = torch.bfloat16
    hidden, inter, m = 64, 96, 2
    act = torch.randn(m, 2 * inter, generator=g).to(bf)
    residual = torch.randn(m, hidden, generator=g).to(bf)
    down = (torch.randn(hidden, inter, generator=g) / inter**0.5).to(bf)
    up = (torch.randn(2 * inter, hidden, generator=g) / hidden**0.5).to(bf)
    norm_w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(bf)
    dev = [t.to(triton_device) for t in (act, residual, down, up, norm_w)]
    h, squares = residual_linear(dev[0], dev[2], dev[1], gated=True, backend="triton")
    assert squares is not None
    out = norm_linear(h, squares, dev[4], 1e-6, dev[3], backend="triton")
    h_ref, none = residual_linear(act, down, residual, gated=True, backend="reference")
    assert none is None
    torch.testing.assert_close(h.cpu().float(), h_ref.float(), atol=2e-2, rtol=2**-6)
    out_ref = norm_linear(h_ref, None, norm_w, 1e-6, up, backend="reference")
    torch.testing.assert_close(out.cpu().float(), out_ref.float(), atol=3e-2, rtol=2**-5)
    assert torch.equal(
        gated_linear(act, down, backend="reference"), linear(silu_and_mul(act, backend="reference"), down)
    )


def test_bad_inputs_are_refused():
    bf = torch.bfloat16
    x, w, r = torch.zeros(2, 8, dtype=bf), torch.zeros(4, 8, dtype=bf), torch.zeros(2, 4, dtype=bf)
    with pytest.raises(ValueError, match="2 \\* K"):
        gated_linear(x, w)
    with pytest.raises(ValueError, match="residual must be"):
        residual_linear(x, w, torch.zeros(2, 5, dtype=bf))
    with pytest.raises(ValueError, match="residual must be"):
        residual_linear(x, w, r.float())
    with pytest.raises(ValueError, match="squares must be"):
        norm_linear(x, torch.zeros(3, 2), torch.ones(8, dtype=bf), 1e-6, w, backend="triton")
