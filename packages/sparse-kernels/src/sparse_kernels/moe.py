"""Fused mixture-of-experts layer (SwiGLU experts): Triton grouped GEMMs + a plain-torch reference.

Each token goes to ``k`` experts (Shazeer et al. 2017, https://arxiv.org/abs/1701.06538); expert ``e``
is a SwiGLU MLP ``down_e(silu(gate_e(x)) * up_e(x))`` and the token's output is the sum of its experts'
outputs times their routing weights. Which experts and what weights is the router's business (the
model's); this file takes the router's ``topk_ids`` / ``topk_weights`` as given.

The Triton path (``sparse_kernels._triton.moe``): sort the step's (token, expert) entries by expert
into single-expert tiles (``moe_align``), one grouped GEMM over gate/up with ``silu(gate) * up`` in its
epilogue, one grouped GEMM over down with the routing weight in its epilogue, then each token's ``k``
contributions summed in fp32. Graph-safe (no host sync, shapes fixed by ``T``), and a decode step
reads only its routed experts' weights.

Four launches a layer (align, gate/up, down, the sum). The sum keeps its own: folding it into down's
epilogue as atomic adds would need a zeroed fp32 output and a cast after it (two launches for one, and
a summation order that changes from run to run), and it moves ``2 * T * k * H`` values, 8 MB at
Qwen3-30B-A3B's T = 256, under 1% of the 1.2 GB of experts such a step reads.

Rounding (both paths): gate/up and down outputs rounded to the input dtype as ``F.linear`` rounds
them, ``silu(gate) * up`` as ``silu_and_mul``, each contribution ``round(y * weight)``, the ``k``
contributions summed in fp32 and rounded once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sparse_kernels._backend import resolve_backend
from sparse_kernels.moe_align import align_by_expert
from sparse_kernels.silu_mul import silu_and_mul_reference


def _tile(block_n: int, block_k: int, num_warps: int, num_stages: int) -> dict:
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": num_warps, "num_stages": num_stages}


# Tile shapes by step size: (largest T * k, config), the first row whose bound holds the step's
# entries, else PREFILL_CONFIG. BLOCK_M is shared (the align step's tiles); each GEMM has its own tile
# (gate/up is [2 * 768, 2048] per expert at Qwen3-30B-A3B's shape, down [2048, 768]).
# Decode up to 1024 entries (T = 128 at k = 8, 8 entries per expert of 128 on average): every expert's
# tokens in 16-row tiles, so the weights stream once per tile and no padding past 16 rows is computed;
# 32-column tiles give each routed expert 24 gate/up and 64 down programs. On the H200 (moe_probe at
# 6a72e0f, results/bench/h200/models/moe_probe_decode.*) a layer ran at 88-94% of copy bandwidth for
# T = 8..128 (the 64-row tile: 86-87% at T = 64..128), but at T = 256 (2048 entries) 73% against the
# 64-row tile's 84%, so the bound is 1024. ``benchmarks/moe_probe.py --sweep`` times alternatives per
# T and prints rows in this form.
MOE_CONFIGS: tuple[tuple[int, dict], ...] = (
    (1024, {"BLOCK_M": 16, "gate_up": _tile(32, 256, 4, 4), "down": _tile(32, 256, 4, 4)}),
)
PREFILL_CONFIG = {"BLOCK_M": 64, "gate_up": _tile(128, 64, 4, 3), "down": _tile(128, 64, 4, 3)}


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    backend: str = "auto",
    config: dict | None = None,
) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t])`` for every token ``t``.

    Parameters
    ----------
    hidden : ``[T, H]`` float32 / bfloat16 / float16, unit stride on H.
    w13 : ``[E, 2 * I, H]`` in ``hidden.dtype``: expert ``e``'s gate rows ``[0, I)`` then up rows
        ``[I, 2I)`` (the layout of HF's fused ``gate_up_proj``), unit stride on H.
    w2 : ``[E, H, I]`` in ``hidden.dtype``, unit stride on I.
    topk_ids : ``[T, k]`` int32 / int64 in ``[0, E)``; a token's ``k`` ids should differ (a repeated
        id counts twice).
    topk_weights : ``[T, k]`` float (cast to fp32).
    backend : ``"auto"`` (Triton on CUDA, reference on CPU; ``SPARSE_KERNELS_BACKEND`` overrides),
        ``"triton"`` (CPU tensors run under the interpreter: tests) or ``"reference"``.
    config : Triton tile shape: ``BLOCK_M`` and, per GEMM under ``"gate_up"`` / ``"down"`` (or flat,
        for both), ``BLOCK_N``, ``BLOCK_K``, ``num_warps``, ``num_stages``; default ``moe_config(T * k)``.

    Returns
    -------
    ``[T, H]`` in ``hidden.dtype``, a new tensor.
    """
    _check(hidden, w13, w2, topk_ids, topk_weights)
    if hidden.shape[0] and resolve_backend(backend, hidden.device) == "triton":
        config = config or moe_config(topk_ids.numel(), hidden.element_size())
        return _fused_moe_triton(hidden, w13, w2, topk_ids, topk_weights, config)
    return fused_moe_reference(hidden, w13, w2, topk_ids, topk_weights)


def moe_config(num_entries: int, element_size: int = 2) -> dict:
    """Tile shape for a step of ``num_entries = T * k`` entries of ``element_size``-byte values.

    The ``MOE_CONFIGS`` row for the step's size (``PREFILL_CONFIG`` past the last), as
    ``{"BLOCK_M", "gate_up": {...}, "down": {...}}``. fp32 halves ``BLOCK_K`` (4 stages of 256-wide
    fp32 tiles overflow the H200's 227 KB of shared memory).
    """
    config = next((c for bound, c in MOE_CONFIGS if num_entries <= bound), PREFILL_CONFIG)
    if element_size > 2:
        config = {k: {**v, "BLOCK_K": v["BLOCK_K"] // 2} if isinstance(v, dict) else v for k, v in config.items()}
    return config


def gemm_config(config: dict, gemm: str) -> dict:
    """``config``'s tile for ``gemm`` (``"gate_up"`` or ``"down"``): its own entry, else the flat keys."""
    return config.get(gemm, config)


def _fused_moe_triton(hidden, w13, w2, topk_ids, topk_weights, config: dict) -> torch.Tensor:
    from sparse_kernels._triton.moe import moe_gemm_triton

    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("the Triton path needs w13 and w2 with unit stride on their last dimension")
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    num_tokens, top_k = topk_ids.shape
    tiles = align_by_expert(topk_ids, w13.shape[0], config["BLOCK_M"], backend="triton")
    weights = topk_weights.reshape(-1).float().contiguous()  # [T * k], entry order
    up = gemm_config(config, "gate_up")
    act = moe_gemm_triton(hidden, w13, tiles, gated=True, a_row_div=top_k, topk_weights=None, config=up)
    down = gemm_config(config, "down")
    contrib = moe_gemm_triton(act, w2, tiles, gated=False, a_row_div=1, topk_weights=weights, config=down)
    return contrib.view(num_tokens, top_k, -1).sum(1)  # one launch; reduced-precision sums accumulate in fp32


def fused_moe_reference(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """Plain-torch ``fused_moe``: a loop over the experts that have tokens (host syncs; CPU and tests)."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    weights = topk_weights.float()
    for expert in torch.unique(topk_ids).tolist():
        tokens, slot = torch.nonzero(topk_ids == expert, as_tuple=True)
        act = silu_and_mul_reference(F.linear(hidden[tokens], w13[expert]))
        y = F.linear(act, w2[expert])
        out.index_add_(0, tokens, (y.float() * weights[tokens, slot, None]).to(hidden.dtype).float())
    return out.to(hidden.dtype)


def _check(hidden, w13, w2, topk_ids, topk_weights) -> None:
    if hidden.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"hidden [T, H], w13 [E, 2I, H], w2 [E, H, I] expected, got {list(hidden.shape)}, "
            f"{list(w13.shape)}, {list(w2.shape)}"
        )
    num_experts, two_i, h = w13.shape
    if h != hidden.shape[1] or two_i % 2 or tuple(w2.shape) != (num_experts, h, two_i // 2):
        raise ValueError(
            f"shapes disagree: hidden {list(hidden.shape)}, w13 {list(w13.shape)}, w2 {list(w2.shape)} "
            "(expected w13 [E, 2I, H] and w2 [E, H, I])"
        )
    if topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_ids and topk_weights must both be [T, k] with T = {hidden.shape[0]}, got "
            f"{list(topk_ids.shape)} and {list(topk_weights.shape)}"
        )
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if w13.dtype != hidden.dtype or w2.dtype != hidden.dtype:
        raise ValueError(f"hidden, w13 and w2 must share a dtype, got {hidden.dtype}, {w13.dtype}, {w2.dtype}")
    if len({hidden.device, w13.device, w2.device, topk_ids.device, topk_weights.device}) != 1:
        raise ValueError("all tensors must be on one device")
