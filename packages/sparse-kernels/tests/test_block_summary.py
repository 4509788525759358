"""block_summary (Triton and reference) against a per-block loop, and Quest's page upper bound."""

from __future__ import annotations

import pytest
import torch

from sparse_kernels import block_summary, block_upper_bound


def _pool(num_blocks, block_size, num_kv_heads, head_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)


@pytest.mark.parametrize(
    ("block_size", "head_dim", "dtype", "summary_dtype"),
    [
        (16, 64, torch.float32, torch.float32),
        (16, 128, torch.bfloat16, torch.bfloat16),
        (1, 128, torch.bfloat16, torch.float32),
        (16, 64, torch.bfloat16, torch.float32),
    ],
)
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_summary_matches_loop(block_size, head_dim, dtype, summary_dtype, backend, triton_device):
    device = triton_device if backend == "triton" else "cpu"
    k_cache = _pool(12, block_size, 2, head_dim, dtype)
    ids = [7, 0, 11, 3, 5]
    valid = [block_size, 1, max(1, block_size // 2), 0, block_size]  # block 3: nothing valid, left alone
    kmin = torch.full((12, 2, head_dim), 9.0, dtype=summary_dtype)
    kmax = torch.full((12, 2, head_dim), -9.0, dtype=summary_dtype)
    exp_min, exp_max = kmin.clone(), kmax.clone()
    for b, n in zip(ids, valid, strict=True):
        if n:
            exp_min[b] = k_cache[b, :n].amin(0).to(summary_dtype)
            exp_max[b] = k_cache[b, :n].amax(0).to(summary_dtype)
    kmin, kmax, k_dev = kmin.to(device), kmax.to(device), k_cache.to(device)
    block_summary(
        k_dev,
        torch.tensor(ids, dtype=torch.int32, device=device),
        torch.tensor(valid, dtype=torch.int32, device=device),
        kmin,
        kmax,
        backend=backend,
    )
    torch.testing.assert_close(kmin.cpu(), exp_min, atol=0, rtol=0)
    torch.testing.assert_close(kmax.cpu(), exp_max, atol=0, rtol=0)


def test_summary_rejects_bad_inputs():
    k_cache = _pool(4, 4, 2, 8, torch.float32)
    ids = torch.tensor([0], dtype=torch.int32)
    ok = torch.zeros(4, 2, 8)
    with pytest.raises(ValueError, match="kmin must be"):
        block_summary(k_cache, ids, ids, torch.zeros(4, 2, 4), ok)
    with pytest.raises(ValueError, match="equal-length"):
        block_summary(k_cache, ids, torch.tensor([1, 1], dtype=torch.int32), ok, ok.clone())
    with pytest.raises(ValueError, match="int32 or int64"):
        block_summary(k_cache, ids.float(), ids, ok, ok.clone())


@pytest.mark.parametrize("group", [1, 4])
def test_upper_bound_bounds_every_key_and_matches_formula(group):
    gen = torch.Generator().manual_seed(1)
    block_size, num_kv_heads, head_dim = 4, 2, 16
    k_cache = torch.randn(10, block_size, num_kv_heads, head_dim, generator=gen)
    kmin, kmax = torch.empty(10, num_kv_heads, head_dim), torch.empty(10, num_kv_heads, head_dim)
    ids = torch.arange(10, dtype=torch.int32)
    block_summary(k_cache, ids, torch.full((10,), block_size, dtype=torch.int32), kmin, kmax, backend="reference")
    q = torch.randn(3, num_kv_heads * group, head_dim, generator=gen)
    kv_indptr = torch.tensor([0, 4, 5, 9], dtype=torch.int32)
    kv_indices = torch.tensor([2, 7, 0, 9, 4, 1, 3, 5, 8], dtype=torch.int32)
    bound = block_upper_bound(q, kmin, kmax, kv_indptr, kv_indices)
    assert bound.shape == (num_kv_heads * group, 9) and bound.dtype == torch.float32
    for i, block in enumerate(kv_indices.tolist()):
        b = int(torch.searchsorted(kv_indptr, torch.tensor(i), right=True)) - 1
        for hq in range(num_kv_heads * group):
            h = hq // group
            exact = k_cache[block, :, h] @ q[b, hq]  # [block_size]
            assert bound[hq, i] >= exact.max() - 1e-5
            formula = torch.maximum(q[b, hq] * kmax[block, h], q[b, hq] * kmin[block, h]).sum()
            torch.testing.assert_close(bound[hq, i], formula)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize(("scheme", "bits"), [("fp8", 8), ("turboquant", 3)])
def test_quantized_summary_is_the_min_max_of_the_dequantized_keys(scheme, bits, backend, triton_device):
    """Per listed block, the min / max over its first num_valid tokens of the keys attention reads (fp8:
    codes x scale; TurboQuant: codebook level x scale, rotated back), written at the block's row; a row
    with num_valid 0 (a padded decode row) writes nothing (it repeats row 0's write). As int8 codes (with a
    scale), the Triton kernel's fp8 summaries equal the reference's code for code."""
    from sparse_kernels.block_summary import quantized_block_summary
    from sparse_kernels.kv_quant import allocate_quantized_kv, unpack_codes
    from sparse_kernels.quantized_store import store_kv_quantized

    device = triton_device if backend == "triton" else "cpu"
    g = torch.Generator().manual_seed(3)
    blocks, bs, h, d = 6, 4, 2, 32
    kv = allocate_quantized_kv(scheme, bits, blocks, bs, h, d, torch.float32, device, seed=1)
    keys = torch.randn(blocks * bs, h, d, generator=g).to(device)
    slots = torch.arange(blocks * bs, dtype=torch.int32, device=device)
    store_kv_quantized(keys, torch.randn_like(keys), kv, slots, backend=backend)
    if scheme == "fp8":
        read = kv.k.float() * kv.k_scale[..., None].float()
    else:
        read = (kv.codebook[unpack_codes(kv.k, bits, d)] * kv.k_scale[..., None].float()) @ kv.rotation.T
    read = read.cpu()
    kmin = torch.full((blocks, h, d), 7.0, device=device)
    kmax = torch.full((blocks, h, d), -7.0, device=device)
    ids, valid = torch.tensor([3, 1, 5, 0], device=device), torch.tensor([2, 4, 1, 0], device=device)  # last: padding
    quantized_block_summary(kv, ids, valid, kmin, kmax, backend=backend)
    kmin, kmax, ids, valid = kmin.cpu(), kmax.cpu(), ids.cpu(), valid.cpu()
    codes = [torch.zeros(blocks, h, d, dtype=torch.int8, device=device) for _ in range(2)]
    scales = torch.zeros(blocks, h, device=device)
    quantized_block_summary(kv, ids.to(device), valid.to(device), *codes, scale=scales, backend=backend)
    ref = [torch.zeros(blocks, h, d, dtype=torch.int8) for _ in range(2)]
    ref_scales = torch.zeros(blocks, h)
    cpu_kv = type(kv)(**{f: (getattr(kv, f).cpu() if isinstance(getattr(kv, f), torch.Tensor) else getattr(kv, f))
                         for f in kv.__dataclass_fields__})  # fmt: skip
    quantized_block_summary(cpu_kv, ids, valid, *ref, scale=ref_scales, backend="reference")
    assert torch.equal(codes[0].cpu(), ref[0]) and torch.equal(codes[1].cpu(), ref[1])
    assert torch.equal(scales.cpu(), ref_scales)
    for b, n in zip(ids[:3].tolist(), valid[:3].tolist(), strict=True):
        torch.testing.assert_close(kmin[b], read[b, :n].amin(0))
        torch.testing.assert_close(kmax[b], read[b, :n].amax(0))
    for b in (0, 2, 4):  # untouched, the padding row's block 0 included
        assert (kmin[b] == 7.0).all() and (kmax[b] == -7.0).all()
    assert (kmax[ids[:3]] >= kmin[ids[:3]]).all()
