"""Single-sequence attention oracle: the plain definition every batched kernel is tested against."""

from __future__ import annotations

import torch


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sm_scale: float | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Attention of one sequence whose queries are the last ``Tq`` of its ``Tk`` positions.

    Parameters
    ----------
    q : torch.Tensor
        ``[Tq, num_qo_heads, head_dim]``. Query ``i`` sits at position ``Tk - Tq + i``.
    k, v : torch.Tensor
        ``[Tk, num_kv_heads, head_dim]`` and ``[Tk, num_kv_heads, v_dim]`` (``v_dim`` may differ, as in
        multi-head latent attention), contiguous in sequence order. ``num_qo_heads`` must be a
        multiple of ``num_kv_heads`` (GQA: query head ``h`` reads KV head ``h // g``).
    sm_scale : float, optional
        Softmax scale; ``head_dim ** -0.5`` by default.
    causal : bool
        If True, query ``i`` attends to key ``j`` only when ``j <= Tk - Tq + i``; else to all keys.

    Returns
    -------
    torch.Tensor
        ``[Tq, num_qo_heads, v_dim]`` in ``q``'s dtype; scores and softmax are computed in float32.
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or k.shape[:2] != v.shape[:2]:
        raise ValueError(
            f"expected q [Tq,Hq,D], k [Tk,Hkv,D], v [Tk,Hkv,Dv]; "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    num_q, num_qo_heads, head_dim = q.shape
    num_k, num_kv_heads, _ = k.shape
    if k.shape[2] != head_dim or num_qo_heads % num_kv_heads != 0:
        raise ValueError(f"incompatible heads/head_dim: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if causal and num_q > num_k:
        raise ValueError(f"causal attention needs Tq <= Tk; got Tq={num_q}, Tk={num_k}")
    scale = head_dim**-0.5 if sm_scale is None else sm_scale
    group = num_qo_heads // num_kv_heads
    k = k.float().repeat_interleave(group, dim=1)  # [Tk, Hq, D]
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale  # [Hq, Tq, Tk]
    if causal:
        q_pos = torch.arange(num_k - num_q, num_k, device=q.device)
        k_pos = torch.arange(num_k, device=q.device)
        scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
