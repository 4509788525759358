"""Raw attention logits of a batch of decode queries over their paged keys, read through each row's
block table: ``out[b, hq, j] = scale * q[b, hq] . k_j`` for token ``j`` of row ``b`` (``-inf`` past
the row's length). A method that scores tokens from the whole distribution (softmax per query head,
then its own reduction) builds on it without gathering keys. Fixed grid (``max_tokens`` static), so
it can run inside a CUDA graph. Over an fp8 store (``k_scale``) the keys are e4m3 codes times a scale
per (token, KV head), dequantized as they are read.
"""

from __future__ import annotations

import torch

from sparse_kernels._backend import resolve_backend


def paged_logits(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    table_indices: torch.Tensor,
    table_start: torch.Tensor,
    kv_lens: torch.Tensor,
    out: torch.Tensor,
    *,
    scale: float,
    k_scale: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Write float32 ``out`` ``[B, num_qo_heads, max_tokens]`` and return it.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, num_qo_heads, head_dim]`` (query head ``hq`` reads KV head ``hq // group``).
    k_cache : torch.Tensor
        ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous.
    table_indices : torch.Tensor
        int32 block ids; row ``b``'s token ``j`` is slot ``table_indices[table_start[b] + j // block_size]
        * block_size + j % block_size``.
    table_start, kv_lens : torch.Tensor
        int32 or int64 ``[B]`` on the device; ``kv_lens[b] <= max_tokens``.
    out : torch.Tensor
        float32 ``[B, num_qo_heads, max_tokens]``, contiguous, caller-owned.
    scale : float
        Multiplies every logit (the softmax scale).
    k_scale : torch.Tensor, optional
        float32 ``[num_blocks, block_size, num_kv_heads]``: ``k_cache`` holds fp8 codes and key ``j`` is
        ``k_cache[slot] * k_scale[slot]`` (an fp8 store's ``QuantizedKV.k`` / ``k_scale``).
    """
    batch, num_qo_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if k_cache.dim() != 4 or k_cache.shape[3] != head_dim or num_qo_heads % num_kv_heads:
        raise ValueError(f"incompatible q {list(q.shape)} and k_cache {list(k_cache.shape)}")
    if out.dim() != 3 or tuple(out.shape[:2]) != (batch, num_qo_heads) or out.dtype != torch.float32:
        raise ValueError(f"out must be float32 [{batch}, {num_qo_heads}, max_tokens], got {list(out.shape)}")
    if table_start.shape != (batch,) or kv_lens.shape != (batch,):
        raise ValueError(f"table_start and kv_lens must be [B] = [{batch}]")
    check_token_scale("k_scale", k_scale, k_cache)
    if batch == 0:
        return out
    if resolve_backend(backend, q.device) == "triton":
        from sparse_kernels._triton.paged_logits import paged_logits_triton

        return paged_logits_triton(q, k_cache, table_indices, table_start, kv_lens, out, scale, k_scale=k_scale)
    max_tokens = out.shape[2]
    tok = torch.arange(max_tokens, device=q.device)[None, :]
    lens = kv_lens.to(torch.int64)[:, None]
    t = torch.minimum(tok, lens - 1)
    blocks = table_indices.to(torch.int64)[table_start.to(torch.int64)[:, None] + t // block_size]
    slots = blocks * block_size + t % block_size
    keys = k_cache.view(-1, num_kv_heads, head_dim)[slots].float()  # [B, L, Hkv, D]
    if k_scale is not None:
        keys = keys * k_scale.reshape(-1, num_kv_heads)[slots][..., None]
    group = num_qo_heads // num_kv_heads
    keys = keys.repeat_interleave(group, dim=2)  # [B, L, Hq, D]
    logits = torch.einsum("bhd,blhd->bhl", q.float(), keys) * scale
    out.copy_(logits.masked_fill((tok >= lens)[:, None, :], float("-inf")))
    return out


def check_token_scale(name: str, scale: torch.Tensor | None, cache: torch.Tensor) -> None:
    """``scale``: None, or the float32 ``[num_blocks, block_size, num_kv_heads]`` scales of an fp8 ``cache``."""
    if scale is None:
        return
    if cache.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name} goes with an fp8 (e4m3) cache, got {cache.dtype}")
    if tuple(scale.shape) != tuple(cache.shape[:3]) or scale.dtype != torch.float32 or not scale.is_contiguous():
        shape = list(cache.shape[:3])
        raise ValueError(f"{name} must be contiguous float32 {shape}, got {scale.dtype} {list(scale.shape)}")
