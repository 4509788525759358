"""Raw attention logits of a batch of decode queries over their paged keys, read through each row's
block table: ``out[b, hq, j] = scale * q[b, hq] . k_j`` for token ``j`` of row ``b`` (``-inf`` past
the row's length). A method that scores tokens from the whole distribution (softmax per query head,
then its own reduction) builds on it without gathering keys. Fixed grid (``max_tokens`` static), so
it can run inside a CUDA graph. Over an fp8 store (``k_scale``) the keys are e4m3 codes times a scale
per (token, KV head), dequantized as they are read; over TurboQuant (``k_scale`` and ``codebook``) codebook
levels of packed indices times the scale, in the rotated space (the caller passes the rotated query).
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
    codebook: torch.Tensor | None = None,
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
    codebook : torch.Tensor, optional
        float32 ``[2**bits]`` (with ``k_scale``): ``k_cache`` holds TurboQuant's int32-packed codebook indices
        ``[num_blocks, block_size, num_kv_heads, words]`` and key ``j`` is ``codebook[codes] * k_scale[slot]``,
        in the rotated space: pass ``q @ R`` (``QuantizedKV.rotation``).
    """
    batch, num_qo_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    width = head_dim if codebook is None else check_codebook("k", k_cache, k_scale, codebook, head_dim)
    if k_cache.dim() != 4 or k_cache.shape[3] != width or num_qo_heads % num_kv_heads:
        raise ValueError(f"incompatible q {list(q.shape)} and k_cache {list(k_cache.shape)}")
    if out.dim() != 3 or tuple(out.shape[:2]) != (batch, num_qo_heads) or out.dtype != torch.float32:
        raise ValueError(f"out must be float32 [{batch}, {num_qo_heads}, max_tokens], got {list(out.shape)}")
    if table_start.shape != (batch,) or kv_lens.shape != (batch,):
        raise ValueError(f"table_start and kv_lens must be [B] = [{batch}]")
    if codebook is None:
        check_token_scale("k_scale", k_scale, k_cache)
    if batch == 0:
        return out
    if resolve_backend(backend, q.device) == "triton":
        from sparse_kernels._triton.paged_logits import paged_logits_triton

        args = (q, k_cache, table_indices, table_start, kv_lens, out, scale)
        return paged_logits_triton(*args, k_scale=k_scale, codebook=codebook)
    max_tokens = out.shape[2]
    tok = torch.arange(max_tokens, device=q.device)[None, :]
    lens = kv_lens.to(torch.int64)[:, None]
    t = torch.minimum(tok, lens - 1)
    blocks = table_indices.to(torch.int64)[table_start.to(torch.int64)[:, None] + t // block_size]
    slots = blocks * block_size + t % block_size
    keys = read_rows(k_cache, k_scale, codebook, slots, head_dim)  # [B, L, Hkv, D]
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


def check_codebook(name: str, codes: torch.Tensor, scale: torch.Tensor | None, codebook: torch.Tensor, head_dim: int):
    """TurboQuant's packed ``codes`` with their ``scale`` and ``codebook``; returns the words per row."""
    from sparse_kernels.quantized_kv import BITS, words_per_row

    bits = codebook.numel().bit_length() - 1
    if codebook.dim() != 1 or codebook.numel() != 1 << bits or bits not in BITS["turboquant"]:
        shape = list(codebook.shape)
        raise ValueError(f"codebook must be float32 [2**bits] for bits in {BITS['turboquant']}, got {shape}")
    if codes.dtype != torch.int32:
        raise ValueError(f"{name} codes (with a codebook) must be int32 packed indices, got {codes.dtype}")
    if scale is None or tuple(scale.shape) != tuple(codes.shape[:3]) or scale.dtype != torch.float32:
        raise ValueError(f"a codebook needs {name}_scale, float32 {list(codes.shape[:3])}")
    return words_per_row("turboquant", bits, head_dim)


def read_rows(cache, scale, codebook, slots: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Reference: float32 ``[..., num_kv_heads, head_dim]`` rows of ``slots`` (plain, fp8 codes times their
    scale, or TurboQuant levels times their scale, still rotated)."""
    from sparse_kernels.kv_quant import decode_rows

    num_kv_heads = cache.shape[2]
    rows = cache.reshape(-1, num_kv_heads, cache.shape[3])[slots]
    if scale is None:
        return rows.float()
    scheme, bits = ("fp8", 8) if codebook is None else ("turboquant", codebook.numel().bit_length() - 1)
    return decode_rows(rows, scale.reshape(-1, num_kv_heads)[slots], scheme, bits, head_dim, codebook=codebook)
