"""fused_moe: the reference against a per-token formula, the align step's invariants, and Triton against
the reference (natively on CUDA, else under Triton's interpreter) over ragged expert loads, experts with
no tokens, k = 1 and k > 1, both tile shapes and fp32 / bf16.

Tolerances: fp32 sums in another order (1e-5); bf16 rounds at the same points as the reference, but a
GEMM's fp32 sum in another order can flip a rounding of an intermediate, so bf16 is held to 2e-2.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sparse_kernels import fused_moe
from sparse_kernels._triton.compile_check import compiling_for
from sparse_kernels.moe import fused_moe_reference, moe_config
from sparse_kernels.moe_align import align_by_expert, max_expert_tiles

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
SMALL = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2}  # one tile for both GEMMs
LARGE = {  # a tile per GEMM
    "BLOCK_M": 32,
    "gate_up": {"BLOCK_N": 32, "BLOCK_K": 16, "num_warps": 4, "num_stages": 2},
    "down": {"BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2},
}


def _weights(num_experts, hidden, inter, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5).to(dtype)
    return w13, w2


def _routing(num_tokens, num_experts, top_k, *, skew=0.0, seed=0):
    """Distinct experts per token; ``skew`` > 0 crowds low expert ids (ragged loads, idle experts)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, generator=g) - skew * torch.arange(num_experts) / num_experts
    ids = scores.topk(top_k, dim=1).indices
    weights = torch.rand(num_tokens, top_k, generator=g)
    return ids, weights / weights.sum(1, keepdim=True)


def test_reference_matches_per_token_formula():
    hidden, inter, num_experts, top_k = 24, 10, 6, 3
    w13, w2 = _weights(num_experts, hidden, inter, torch.float64)
    x = torch.randn(7, hidden, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ids, weights = _routing(7, num_experts, top_k)
    expected = torch.zeros_like(x)
    for t in range(7):
        for j in range(top_k):
            gate, up = (w13[ids[t, j]] @ x[t]).chunk(2)
            expected[t] += weights[t, j].double() * (w2[ids[t, j]] @ (F.silu(gate) * up))
    torch.testing.assert_close(fused_moe_reference(x, w13, w2, ids, weights), expected)


# (tokens, top_k, block_m, experts); (300, 8, ...) spans three counting chunks of the Triton kernel.
ALIGN_CASES = [(1, 1, 16, 16), (1, 8, 16, 16), (37, 2, 16, 20), (64, 4, 8, 16), (300, 3, 16, 12), (300, 8, 16, 16)]


@pytest.mark.parametrize(("num_tokens", "top_k", "block_m", "num_experts"), ALIGN_CASES)
@pytest.mark.parametrize("skew", [0.0, 3.0])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_align_groups_every_entry_once_in_single_expert_tiles(
    num_tokens, top_k, block_m, num_experts, skew, backend, triton_device
):
    ids, _ = _routing(num_tokens, num_experts, top_k, skew=skew, seed=num_tokens)
    device = triton_device if backend == "triton" else "cpu"
    tiles = align_by_expert(ids.to(device), num_experts, block_m, backend=backend)
    n = num_tokens * top_k
    assert tiles.num_tiles == max_expert_tiles(n, num_experts, block_m)
    if backend == "triton":  # the one-launch kernel and the torch ops agree exactly
        ref = align_by_expert(ids, num_experts, block_m, backend="reference")
        assert torch.equal(tiles.sorted_ids.cpu(), ref.sorted_ids)
        assert torch.equal(tiles.tile_experts.cpu(), ref.tile_experts)
    rows = tiles.sorted_ids.cpu().view(-1, block_m).long()
    flat = ids.reshape(-1)
    real = rows < n
    assert sorted(rows[real].tolist()) == list(range(n))  # every entry exactly once
    for tile, expert in enumerate(tiles.tile_experts.cpu().tolist()):
        entries = rows[tile][real[tile]]
        if expert == num_experts:  # grid padding: nothing in it
            assert entries.numel() == 0
            continue
        assert entries.numel() > 0 and (flat[entries] == expert).all()  # one expert, no empty tiles
        assert (entries.diff() > 0).all()  # entry order within an expert
        assert real[tile][: entries.numel()].all()  # padding only after an expert's last entry
    used = tiles.tile_experts.cpu()[tiles.tile_experts.cpu() < num_experts]
    assert (used.diff() >= 0).all()  # experts in ascending order
    expected_tiles = sum(-(-int((flat == e).sum()) // block_m) for e in range(num_experts))
    assert used.numel() == expected_tiles  # a tile per started block of each non-empty expert only


def test_align_tile_bound_is_tight_at_decode():
    # One token, k = 8 of 128 experts: 8 tiles however it is routed, so a decode step reads 8 experts.
    assert max_expert_tiles(8, 128, 16) == 8
    assert max_expert_tiles(0, 128, 16) == 0


CASES = [  # (tokens, experts, top_k, hidden, inter, skew)
    (1, 8, 1, 64, 32, 0.0),  # decode, k = 1
    (1, 16, 4, 48, 40, 0.0),  # decode, k > 1, ragged K and N tails
    (1, 16, 8, 32, 16, 0.0),
    (7, 5, 2, 64, 24, 3.0),  # skewed: some experts take many tokens, others none
    (33, 16, 8, 40, 48, 4.0),  # k = 8 of 16, as at Qwen3-30B-A3B's decode (8 of 128); idle experts
    (70, 6, 3, 32, 16, 0.0),  # more than one tile per expert
]


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "hidden", "inter", "skew"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", [SMALL, LARGE], ids=["tile16", "tile32"])
def test_triton_matches_reference(num_tokens, num_experts, top_k, hidden, inter, skew, dtype, config, triton_device):
    w13, w2 = _weights(num_experts, hidden, inter, dtype, seed=num_tokens)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(2)).to(dtype)
    ids, weights = _routing(num_tokens, num_experts, top_k, skew=skew, seed=num_tokens)
    if skew:
        assert (torch.bincount(ids.reshape(-1), minlength=num_experts) == 0).any()
    expected = fused_moe_reference(x, w13, w2, ids, weights)
    dev = lambda t: t.to(triton_device)  # noqa: E731
    got = fused_moe(dev(x), dev(w13), dev(w2), dev(ids.to(torch.int32)), dev(weights), backend="triton", config=config)
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got.cpu(), expected, **TOL[dtype])


def test_default_decode_tiles_compile_for_hopper(triton_device):
    """bf16 at the default decode config (256-wide K tiles: whole on gate/up, a partial one on down)
    equals the reference, and on CPU the align kernel and both GEMMs also compile for sm_90."""
    num_experts, top_k, hidden, inter = 16, 8, 256, 48
    w13, w2 = _weights(num_experts, hidden, inter, torch.bfloat16)
    x = torch.randn(9, hidden, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    ids, weights = _routing(9, num_experts, top_k, seed=5)
    expected = fused_moe_reference(x, w13, w2, ids, weights)
    dev = lambda t: t.to(triton_device)  # noqa: E731
    with compiling_for():
        got = fused_moe(dev(x), dev(w13), dev(w2), dev(ids), dev(weights), backend="triton")
    torch.testing.assert_close(got.cpu(), expected, **TOL[torch.bfloat16])


def test_triton_reads_only_routed_experts(triton_device):
    """Every expert no token chose holds NaN weights: a read of one would poison the output."""
    num_experts, hidden, inter = 8, 32, 16
    w13, w2 = _weights(num_experts, hidden, inter, torch.float32)
    ids = torch.tensor([[5, 2], [2, 5], [2, 7]])
    weights = torch.rand(3, 2, generator=torch.Generator().manual_seed(3))
    idle = torch.tensor([e for e in range(num_experts) if e not in (2, 5, 7)])
    w13[idle], w2[idle] = float("nan"), float("nan")
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(4))
    expected = fused_moe_reference(x, w13, w2, ids, weights)
    dev = lambda t: t.to(triton_device)  # noqa: E731
    got = fused_moe(dev(x), dev(w13), dev(w2), dev(ids), dev(weights), backend="triton", config=SMALL)
    assert torch.isfinite(expected).all()
    torch.testing.assert_close(got.cpu(), expected, **TOL[torch.float32])


def test_default_config_and_empty_batch():
    # Decode up to T = 128 at k = 8 in 16-row tiles; from T = 256 the 64-row tile (measured faster there).
    assert moe_config(8)["BLOCK_M"] == 16 and moe_config(128 * 8)["BLOCK_M"] == 16
    assert moe_config(256 * 8)["BLOCK_M"] == 64 and moe_config(2048 * 8)["BLOCK_M"] == 64
    for gemm in ("gate_up", "down"):  # fp32 decode tiles fit Hopper's shared memory
        assert moe_config(8, element_size=4)[gemm]["BLOCK_K"] == moe_config(8)[gemm]["BLOCK_K"] // 2
    w13, w2 = _weights(4, 16, 8, torch.float32)
    empty = fused_moe(torch.zeros(0, 16), w13, w2, torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2))
    assert empty.shape == (0, 16)


def test_rejects_mismatched_shapes():
    w13, w2 = _weights(4, 16, 8, torch.float32)
    ids, weights = _routing(3, 4, 2)
    with pytest.raises(ValueError, match="shapes disagree"):
        fused_moe(torch.zeros(3, 16), w13, w2[:, :, :4], ids, weights)
    with pytest.raises(ValueError, match=r"\[T, k\]"):
        fused_moe(torch.zeros(2, 16), w13, w2, ids, weights)
