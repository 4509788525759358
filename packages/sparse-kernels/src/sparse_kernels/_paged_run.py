"""Device-side reference paged attention: batched gather + masked fp32 softmax per planned tile."""

from __future__ import annotations

import torch

from sparse_kernels._paged_plan import PagedPlan
from sparse_kernels._paged_validate import check_run_tensors


def check_run_inputs(plan: PagedPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Shape checks against the plan; they read host metadata only, so they stay graph-safe."""
    check_run_tensors(
        q,
        (plan.num_qo_tokens, plan.num_qo_heads, plan.head_dim),
        k_cache,
        v_cache,
        (plan.block_size, plan.num_kv_heads, plan.head_dim),
    )


def run_paged_attention(
    plan: PagedPlan,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of every planned query over its request's paged K/V.

    Parameters
    ----------
    plan : PagedPlan
        From ``build_plan``; its index tensors live on ``q``'s device.
    q : torch.Tensor
        ``[T, num_qo_heads, head_dim]``.
    k_cache, v_cache : torch.Tensor
        ``[num_blocks, block_size, num_kv_heads, head_dim]``.
    out : torch.Tensor, optional
        ``[T, num_qo_heads, head_dim]`` in ``q``'s dtype, caller-owned (CUDA graphs); allocated if None.

    Returns
    -------
    torch.Tensor
        ``out``, ``[T, num_qo_heads, head_dim]`` in ``q``'s dtype.
    """
    check_run_inputs(plan, q, k_cache, v_cache)
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out must be {list(q.shape)} {q.dtype}, got {list(out.shape)} {out.dtype}")
    num_kv_heads, head_dim = plan.num_kv_heads, plan.head_dim
    group = plan.num_qo_heads // num_kv_heads
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)  # [num_slots, Hkv, D]
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    for tile in plan.tiles:
        bt, nq = tile.q_rows.shape
        qt = q[tile.q_rows].float() * plan.sm_scale  # [bt, nq, Hq, D]
        qt = qt.view(bt, nq, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)  # [bt, Hkv, g, nq, D]
        kt = k_flat[tile.slots].float().permute(0, 2, 1, 3).unsqueeze(2)  # [bt, Hkv, 1, nk, D]
        vt = v_flat[tile.slots].float().permute(0, 2, 1, 3).unsqueeze(2)
        scores = qt @ kt.transpose(-1, -2)  # [bt, Hkv, g, nq, nk]
        scores.masked_fill_(tile.masked, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = (probs @ vt).permute(0, 3, 1, 2, 4).reshape(bt * nq, plan.num_qo_heads, head_dim)
        out.index_copy_(0, tile.dst_rows, o[tile.src_rows].to(out.dtype))
    return out
