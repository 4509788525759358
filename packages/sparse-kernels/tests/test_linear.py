"""linear: the small-M Triton kernel against ``F.linear`` (natively on CUDA, else under Triton's
interpreter), both of its inner products (broadcast-sum and tl.dot), and the dispatch rules.

Tolerances: fp32 sums in another order (1e-5); bf16 inputs are exact in fp32, so the kernel's result is
the fp32 product rounded once to bf16: within one bf16 ulp of the fp32 reference (rtol 2**-7; the
interpreter's fp32 -> bf16 cast may round toward zero, the GPU's rounds to nearest).
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from sparse_kernels import linear
from sparse_kernels._triton.linear import small_m_linear_triton
from sparse_kernels.linear import SMALL_M_MAX, _use_triton, linear_config

FMA = {"USE_DOT": False, "BLOCK_N": 8, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2}
DOT = {"USE_DOT": True, "BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2}


def _inputs(m, n, k, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


def _check_close(got, x, w, b):
    expected = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.dtype == x.dtype and got.shape == expected.shape
    if x.dtype == torch.float32:
        torch.testing.assert_close(got.cpu(), expected, atol=1e-5, rtol=1e-5)
    else:  # one bf16 rounding of the fp32 result
        torch.testing.assert_close(got.cpu().float(), expected, atol=1e-6, rtol=2**-7)


@pytest.mark.parametrize("config", [FMA, DOT], ids=["fma", "dot"])
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(1, 37, 100), (1, 16, 64), (3, 1000, 33), (16, 20, 257), (17, 9, 64)],  # tails in every dim; M > 16
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_f_linear(config, m, n, k, dtype, bias, triton_device):
    x, w, b = _inputs(m, n, k, dtype, bias)
    dev = lambda t: None if t is None else t.to(triton_device)  # noqa: E731
    _check_close(small_m_linear_triton(dev(x), dev(w), dev(b), config), x, w, b)


@pytest.mark.parametrize("config", [FMA, DOT], ids=["fma", "dot"])
@pytest.mark.parametrize(
    ("split_k", "m", "n", "k"), [(2, 1, 37, 100), (3, 5, 40, 257), (4, 16, 20, 96), (8, 3, 17, 64)]
)
@pytest.mark.parametrize("bias", [False, True])
def test_split_k_matches_f_linear_and_leaves_counters_at_zero(config, split_k, m, n, k, bias, triton_device):
    # K cut into SPLIT_K slices of whole BLOCK_K tiles (fewer when K is short: 64 / 32 = 2 of 8 asked); the
    # last split to arrive sums the partials. Two launches in a row: the counters must be back at 0.
    from sparse_kernels._triton import linear as triton_linear

    x, w, b = _inputs(m, n, k, torch.float32, bias, seed=split_k)
    dev = lambda t: None if t is None else t.to(triton_device)  # noqa: E731
    splits = min(split_k, -(-k // config["BLOCK_K"]))  # one slice (no scratch) when K fits one tile
    for _ in range(2):
        _check_close(small_m_linear_triton(dev(x), dev(w), dev(b), {**config, "SPLIT_K": split_k}), x, w, b)
        if splits > 1:  # a test alone in its process has no scratch from earlier tests
            _, arrivals = triton_linear._SCRATCH[dev(x).device]
            assert not arrivals.any()


def test_public_entry_point_reshapes_and_reads_strided_rows(triton_device):
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(2, 3, 80, generator=g)
    x = wide[..., :48]  # rows strided, K contiguous
    w = torch.randn(24, 48, generator=g)
    got = linear(x.to(triton_device), w.to(triton_device), backend="triton")
    assert got.shape == (2, 3, 24)
    torch.testing.assert_close(got.cpu(), F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_weight_row_stride_is_honoured(triton_device):
    # A row slice of a merged weight: rows strided, K contiguous.
    g = torch.Generator().manual_seed(2)
    merged = torch.randn(40, 64, generator=g)
    w = merged[8:30]
    x = torch.randn(2, 64, generator=g)
    got = linear(x.to(triton_device), w.to(triton_device), backend="triton")
    torch.testing.assert_close(got.cpu(), F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_reference_and_cpu_auto_are_f_linear():
    x, w, b = _inputs(2, 12, 20, torch.float32, True)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(linear(x, w, b, backend="reference"), F.linear(x, w, b))


def test_auto_dispatch_rules(monkeypatch):
    cuda_bf16 = torch.empty(0, dtype=torch.bfloat16, device="meta")
    module = sys.modules["sparse_kernels.linear"]  # the package attribute is the function
    monkeypatch.setattr(module, "resolve_backend", lambda backend, device: "triton")
    assert _use_triton("auto", cuda_bf16, 1) and _use_triton("auto", cuda_bf16, SMALL_M_MAX)
    assert not _use_triton("auto", cuda_bf16, SMALL_M_MAX + 1)  # prefill and large batches: cuBLAS
    assert not _use_triton("auto", cuda_bf16.float(), 1)  # fp32 on auto: cuBLAS
    assert _use_triton("triton", cuda_bf16.float(), 100)  # forced: any rows and dtype
    assert not _use_triton("reference", cuda_bf16, 1)


@pytest.mark.parametrize("rows", [1, 2, 8, 16])
def test_configs_fit_the_kernel(rows):
    cfg = linear_config(rows, 4096, 4096)
    assert cfg["BLOCK_N"] >= (16 if cfg["USE_DOT"] else 1) and cfg["BLOCK_K"] >= 16


def test_rejects_bad_inputs():
    x, w, b = _inputs(2, 12, 20, torch.float32, True)
    with pytest.raises(ValueError, match="weight \\[N, K\\]"):
        linear(x, w[:, :10])
    with pytest.raises(ValueError, match="share a dtype"):
        linear(x, w.double())
    with pytest.raises(ValueError, match="bias must be"):
        linear(x, w, b[:5])
    transposed = torch.randn(20, 12).t()  # [12, 20]: K not contiguous
    with pytest.raises(ValueError, match="unit stride"):
        linear(x, transposed, backend="triton")
    assert torch.equal(linear(x, transposed), F.linear(x, transposed))  # the reference takes any layout


def test_launch_settings_follow_the_switches(monkeypatch):
    from sparse_kernels import launch_settings
    from sparse_kernels._triton import launch
    from sparse_kernels._triton import quantized_decode_launch as quantized

    monkeypatch.setattr(launch, "PDL", False)
    monkeypatch.setattr(sys.modules["sparse_kernels.linear"], "SMALL_M_MAX", 4)
    monkeypatch.setitem(quantized.KIVI_DECODE_CONFIG, "SWAP_AB", True)
    monkeypatch.setitem(quantized.QUANT_DECODE_CONFIG, "SWAP_AB", False)
    monkeypatch.setitem(quantized.KIVI_DECODE_CONFIG, "PAIRS", True)
    monkeypatch.setitem(quantized.KIVI_DECODE_CONFIG, "GROUPED", False)
    monkeypatch.setitem(quantized.KIVI_DECODE_CONFIG, "maxnreg", 168)
    assert launch_settings() == {
        "pdl": False,
        "small_m_linear_max_rows": 4,
        "quantized_swap_ab": [False, True],
        "kivi_pairs": True,
        "kivi_grouped": False,
        "kivi_maxnreg": 168,
    }
