"""The scheme math of kv_quant against plain implementations of each paper's formula written here:
codes and scales exact, reconstruction error within each bit width's bound, codebook and rotation."""

from __future__ import annotations

import pytest
import torch

from sparse_kernels import (
    allocate_quantized_kv,
    decode_kivi_pages,
    decode_rows,
    dequantize_blocks,
    encode_kivi_pages,
    encode_rows,
    lloyd_max_codebook,
    pack_codes,
    turboquant_rotation,
    unpack_codes,
)

# Lloyd-Max levels of N(0, 1) (Max 1960), positive half.
KNOWN_LEVELS = {
    2: ([0.4528, 1.5104], 1e-4),
    3: ([0.2451, 0.7560, 1.3440, 2.1520], 2e-4),
    4: ([0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0690, 2.7326], 1e-3),  # 200 iterations stop short
}


def _gaussian(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _rel_rms(approx, exact):
    return float((approx.float() - exact.float()).pow(2).mean().sqrt() / exact.float().pow(2).mean().sqrt())


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_codebook_is_lloyd_max_of_unit_gaussian(bits):
    levels, tol = KNOWN_LEVELS[bits]
    cb = lloyd_max_codebook(bits)
    assert cb.dtype == torch.float32 and cb.shape == (2**bits,)
    assert torch.all(cb[1:] > cb[:-1])
    torch.testing.assert_close(cb, -cb.flip(0), atol=1e-6, rtol=0)
    torch.testing.assert_close(cb[2 ** (bits - 1) :], torch.tensor(levels), atol=tol, rtol=0)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotation_orthogonal_seeded_and_the_q_of_its_gaussian(head_dim):
    r = turboquant_rotation(head_dim, 7)
    assert r.dtype == torch.float32 and r.shape == (head_dim, head_dim)
    torch.testing.assert_close(r @ r.T, torch.eye(head_dim), atol=2e-5, rtol=0)
    assert torch.equal(r, turboquant_rotation(head_dim, 7))
    assert not torch.allclose(r, turboquant_rotation(head_dim, 8))
    # R is the Q of the seeded Gaussian with diag(r) > 0: R.T @ A is upper triangular, positive diagonal.
    a = torch.randn(head_dim, head_dim, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    upper = r.double().T @ a
    assert torch.all(torch.diagonal(upper) > 0)
    torch.testing.assert_close(torch.tril(upper, -1), torch.zeros_like(upper), atol=1e-4, rtol=0)


@pytest.mark.parametrize("bits,n", [(2, 64), (3, 64), (3, 37), (4, 128), (4, 5)])
def test_pack_bit_positions_and_roundtrip(bits, n):
    per_word = 32 // bits
    codes = torch.randint(0, 2**bits, (3, n), generator=torch.Generator().manual_seed(bits))
    words = pack_codes(codes, bits)
    assert words.dtype == torch.int32 and words.shape == (3, -(-n // per_word))
    for row in range(3):
        expected = [0] * words.shape[1]
        for d in range(n):
            expected[d // per_word] |= int(codes[row, d]) << ((d % per_word) * bits)
        got = [w & 0xFFFFFFFF for w in words[row].tolist()]  # the int32's bit pattern
        assert got == expected
    assert torch.equal(unpack_codes(words, bits, n), codes)


def _plain_fp8(x, static=None):
    rows = x.float().reshape(-1, x.shape[-1])
    codes, scales = [], []
    for row in rows:
        s = torch.tensor(static) if static is not None else torch.clamp(row.abs().max() / 448.0, min=1e-12)
        codes.append(torch.clamp(row / s, -448.0, 448.0).to(torch.float8_e4m3fn))
        scales.append(s)
    return torch.stack(codes).view(x.shape), torch.stack(scales).float().view(x.shape[:-1])


@pytest.mark.parametrize("static", [None, 0.01])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_codes_scales_exact_and_error_within_e4m3_rounding(static, dtype):
    x = (_gaussian(40, 3, 64) * torch.logspace(-3, 1, 40)[:, None, None]).to(dtype)
    x[0] = 0  # an all-zero row takes the floor scale
    codes, scale = encode_rows(x, "fp8", 8, static_scale=static)
    exp_codes, exp_scale = _plain_fp8(x, static)
    assert codes.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert torch.equal(codes.view(torch.uint8), exp_codes.view(torch.uint8))
    assert torch.equal(scale, exp_scale)
    out = decode_rows(codes, scale, "fp8", 8, 64)
    y = x.float() / scale[..., None]
    inside = y.abs() <= 448 * (1 + 2**-20)  # x / s may round just past 448; the clamp takes it
    # e4m3 keeps 3 mantissa bits: half an ulp is 2**-4 relative, 2**-10 absolute among subnormals.
    bound = torch.maximum(x.float().abs() * 2**-4, scale[..., None] * 2**-10) * 1.0001
    assert torch.all(((out - x.float()).abs() <= bound)[inside])
    if static is None:
        assert inside.all()


def _plain_asym(x, bits):
    """KIVI's asymmetric quantization of one group (a 1-D tensor)."""
    mn, mx = x.float().min(), x.float().max()
    scale = torch.clamp((mx - mn) / (2**bits - 1), min=2.0**-24).half()
    zero = mn.half()
    codes = torch.clamp(torch.floor((x.float() - zero.float()) / scale.float() + 0.5), 0, 2**bits - 1)
    return codes.long(), scale, zero


@pytest.mark.parametrize("bits,bound", [(2, 0.45), (4, 0.1)])
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (32, 128)])
def test_kivi_pages_exact_against_the_paper_formula(bits, bound, block_size, head_dim):
    pages, heads = 2, 3
    k = _gaussian(pages, block_size, heads, head_dim, seed=1).to(torch.bfloat16)
    v = _gaussian(pages, block_size, heads, head_dim, seed=2).to(torch.bfloat16)
    k[0, :, 1, 5] = 0.25  # a constant channel takes the floor scale
    k_codes, v_codes, k_scale, k_min, v_scale, v_min = encode_kivi_pages(k, v, bits, block_size)
    kc, vc = unpack_codes(k_codes, bits, head_dim), unpack_codes(v_codes, bits, head_dim)
    for p in range(pages):
        for h in range(heads):
            for d in range(head_dim):  # keys: per channel over the page's tokens
                codes, scale, zero = _plain_asym(k[p, :, h, d], bits)
                assert torch.equal(kc[p, :, h, d], codes)
                assert k_scale[p, h, d] == scale and k_min[p, h, d] == zero
            for s in range(block_size):  # values: per token over groups of block_size channels
                for g in range(head_dim // block_size):
                    chans = slice(g * block_size, (g + 1) * block_size)
                    codes, scale, zero = _plain_asym(v[p, s, h, chans], bits)
                    assert torch.equal(vc[p, s, h, chans], codes)
                    assert v_scale[p, s, h, g] == scale and v_min[p, s, h, g] == zero
    k_out, v_out = decode_kivi_pages(k_codes, v_codes, k_scale, k_min, v_scale, v_min, bits, head_dim)
    torch.testing.assert_close(k_out, kc * k_scale[:, None].float() + k_min[:, None].float(), atol=0, rtol=0)
    assert _rel_rms(k_out, k) < bound and _rel_rms(v_out, v) < bound


@pytest.mark.parametrize("bits,bound", [(2, 0.36), (3, 0.2), (4, 0.11)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_turboquant_rows_exact_against_nearest_level(bits, bound, head_dim):
    x = _gaussian(50, 3, head_dim, seed=bits) * 3.0
    rot = turboquant_rotation(head_dim, 0)
    cb = lloyd_max_codebook(bits)
    xr = x @ rot
    codes, scale = encode_rows(xr, "turboquant", bits, codebook=cb)
    exp_scale = torch.clamp(xr.pow(2).mean(-1).sqrt(), min=1e-30)
    torch.testing.assert_close(scale, exp_scale, atol=0, rtol=1e-6)
    # The paper's quantizer: the nearest codebook level to the scaled coordinate.
    nearest = (xr[..., None] / scale[..., None, None] - cb).abs().argmin(-1)
    assert torch.equal(unpack_codes(codes, bits, head_dim), nearest)
    out = decode_rows(codes, scale, "turboquant", bits, head_dim, codebook=cb)
    torch.testing.assert_close(out, cb[nearest] * scale[..., None], atol=0, rtol=0)
    assert _rel_rms(out @ rot.T, x) < bound  # the Lloyd-Max MSE of N(0, 1): 0.118 / 0.035 / 0.0095


@pytest.mark.parametrize("scheme,bits", [("fp8", 8), ("kivi", 2), ("kivi", 4), ("turboquant", 3)])
def test_allocate_and_dequantize_blocks(scheme, bits):
    blocks, size, heads, dim = 5, 16, 3, 64
    kv = allocate_quantized_kv(scheme, bits, blocks, size, heads, dim, torch.bfloat16, "cpu", num_tails=2, seed=3)
    assert kv.scheme == scheme and kv.block_size == size and kv.num_kv_heads == heads and kv.num_blocks == blocks
    assert kv.has_tail == (scheme == "kivi")
    k = _gaussian(blocks, size, heads, dim, seed=4).to(torch.bfloat16)
    v = _gaussian(blocks, size, heads, dim, seed=5).to(torch.bfloat16)
    if scheme == "kivi":
        assert kv.group == size and kv.k_tail.shape == (2, size, heads, dim) and kv.k_tail.dtype == torch.bfloat16
        for name, t in zip(
            ("k", "v", "k_scale", "k_min", "v_scale", "v_min"), encode_kivi_pages(k, v, bits, size), strict=True
        ):
            getattr(kv, name).copy_(t)
    else:
        rot = kv.rotation if scheme == "turboquant" else torch.eye(dim)
        if scheme == "turboquant":
            torch.testing.assert_close(kv.rotation, turboquant_rotation(dim, 3), atol=0, rtol=0)
            torch.testing.assert_close(kv.codebook, lloyd_max_codebook(bits), atol=0, rtol=0)
        for codes, scale, x in ((kv.k, kv.k_scale, k), (kv.v, kv.v_scale, v)):
            c, s = encode_rows(x.float() @ rot, scheme, bits, codebook=kv.codebook)
            codes.copy_(c)
            scale.copy_(s)
    ids = torch.tensor([3, 0, 3], dtype=torch.int32)
    k_out, v_out = dequantize_blocks(kv, ids, dtype=torch.bfloat16)
    assert k_out.shape == (3, size, heads, dim) and k_out.dtype == torch.bfloat16
    bound = {8: 0.05, 2: 0.45, 4: 0.1, 3: 0.2}[bits]
    assert _rel_rms(k_out, k[ids.long()]) < bound and _rel_rms(v_out, v[ids.long()]) < bound
    if scheme == "turboquant":
        k_rot, _ = dequantize_blocks(kv, ids, unrotate=False)
        torch.testing.assert_close(k_rot @ kv.rotation.T, dequantize_blocks(kv, ids)[0], atol=1e-5, rtol=0)


def test_allocate_rejects_bad_layouts():
    with pytest.raises(ValueError, match="scheme/bits"):
        allocate_quantized_kv("kivi", 3, 2, 16, 1, 64, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="must divide head_dim"):
        allocate_quantized_kv("kivi", 4, 2, 32, 1, 48, torch.bfloat16, "cpu")
