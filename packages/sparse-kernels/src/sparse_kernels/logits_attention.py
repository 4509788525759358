"""Decode attention from logits already computed (``paged_logits``): each row's log-sum-exp, then
``softmax @ V`` reading only the values through each row's block table.

A layer that needs every token's logits anyway (a method's filter layer scoring every token) has
read the keys once to write them; attending from those logits reads V and the logits instead of K
and V again. ``logits_lse`` (from ``softmax_stats``' max and sum of ``exp(logit - max)``), or the decode's
own ``lse_out``, gives each (row, query head)'s log-sum-exp, which also turns any logit into its probability
(``exp(l - lse)``) for the method's scores.
Fixed grids, no host sync: graph-safe. Over an fp8 store (``v_scale``) values are e4m3 codes times a
scale per (token, KV head), folded into each token's probability before ``P @ V``.
"""

from __future__ import annotations

import torch

from sparse_kernels._backend import resolve_backend
from sparse_kernels.paged_logits import check_codebook, check_token_scale, read_rows


def softmax_stats(
    logits: torch.Tensor, out_max: torch.Tensor, out_sum: torch.Tensor, *, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``out_max[r] = max_j logits[r, j]`` and ``out_sum[r] = sum_j exp(logits[r, j] - out_max[r])``.

    ``logits``: float32 ``[..., W]`` contiguous, every row with at least one finite entry (``-inf``
    marks columns past a row). ``out_max`` / ``out_sum``: float32 ``[...]``, contiguous.
    """
    lead = tuple(logits.shape[:-1])
    for name, t in (("out_max", out_max), ("out_sum", out_sum)):
        if tuple(t.shape) != lead or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous float32 {list(lead)}, got {t.dtype} {list(t.shape)}")
    if logits.dtype != torch.float32 or not logits.is_contiguous():
        raise ValueError("logits must be contiguous float32")
    if out_max.numel() == 0:
        return out_max, out_sum
    if resolve_backend(backend, logits.device) == "triton":
        from sparse_kernels._triton.logits_attention import softmax_stats_triton

        softmax_stats_triton(logits.view(-1, logits.shape[-1]), out_max.view(-1), out_sum.view(-1))
        return out_max, out_sum
    m = logits.amax(-1)
    out_max.copy_(m)
    out_sum.copy_(torch.exp(logits - m[..., None]).sum(-1))
    return out_max, out_sum


def logits_lse(logits: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """float32 ``[...]`` each row's log-sum-exp of ``logits`` (``[..., W]``, as ``softmax_stats`` takes them):
    its max plus the log of its sum, so that ``exp(logit - lse)`` is the logit's probability."""
    lse, total = (torch.empty(logits.shape[:-1], dtype=torch.float32, device=logits.device) for _ in range(2))
    softmax_stats(logits, lse, total, backend=backend)
    return lse.add_(total.log_())


def logits_attention(
    logits: torch.Tensor,
    logit_lse: torch.Tensor,
    v_cache: torch.Tensor,
    table_indices: torch.Tensor,
    table_start: torch.Tensor,
    kv_lens: torch.Tensor,
    out: torch.Tensor,
    *,
    v_scale: torch.Tensor | None = None,
    codebook: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """``out[b, hq] = sum_j softmax(logits[b, hq])_j * v_j`` over row ``b``'s tokens ``j < kv_lens[b]``.

    Parameters
    ----------
    logits : torch.Tensor
        float32 ``[B, num_qo_heads, W]`` contiguous (``paged_logits``' output: ``-inf`` past a row).
    logit_lse : torch.Tensor
        float32 ``[B, num_qo_heads]``, each row's log-sum-exp of its logits (``logits_lse``, or a decode's
        ``lse_out``): a token's probability is ``exp(logit - logit_lse)``.
    v_cache : torch.Tensor
        ``[num_blocks, block_size, num_kv_heads, head_dim]`` contiguous; query head ``hq`` reads KV
        head ``hq // (num_qo_heads // num_kv_heads)``.
    table_indices, table_start, kv_lens : torch.Tensor
        As ``paged_logits``: token ``j`` of row ``b`` is slot ``table_indices[table_start[b] + j //
        block_size] * block_size + j % block_size``; ``1 <= kv_lens[b] <= W``.
    out : torch.Tensor
        ``[B, num_qo_heads, head_dim]`` (unit stride in the last dim), written in ``out``'s dtype.
    v_scale : torch.Tensor, optional
        float32 ``[num_blocks, block_size, num_kv_heads]``: ``v_cache`` holds fp8 codes and value ``j`` is
        ``v_cache[slot] * v_scale[slot]``.
    codebook : torch.Tensor, optional
        float32 ``[2**bits]`` (with ``v_scale``): ``v_cache`` holds TurboQuant's packed codebook indices and
        value ``j`` is ``codebook[codes] * v_scale[slot]``, in the rotated space (rotate ``out`` back: ``@ R.T``).
    """
    batch, num_qo_heads, width = logits.shape
    _, block_size, num_kv_heads, head_dim = v_cache.shape
    if codebook is not None:
        head_dim = out.shape[-1]
        if v_cache.shape[3] != check_codebook("v", v_cache, v_scale, codebook, head_dim):
            raise ValueError(f"v_cache {list(v_cache.shape)} does not hold {head_dim} channels of these codes")
    if logits.dtype != torch.float32 or not logits.is_contiguous():
        raise ValueError("logits must be contiguous float32")
    if num_qo_heads % num_kv_heads or tuple(out.shape) != (batch, num_qo_heads, head_dim) or out.stride(-1) != 1:
        raise ValueError(
            f"incompatible logits {list(logits.shape)}, v_cache {list(v_cache.shape)}, out {list(out.shape)}"
        )
    if tuple(logit_lse.shape) != (batch, num_qo_heads):
        raise ValueError(f"logit_lse must be [{batch}, {num_qo_heads}]")
    if codebook is None:
        check_token_scale("v_scale", v_scale, v_cache)
    if batch == 0:
        return out
    if resolve_backend(backend, logits.device) == "triton":
        from sparse_kernels._triton.logits_attention import logits_attention_triton

        args = (logits, logit_lse, v_cache, table_indices, table_start, kv_lens, out)
        return logits_attention_triton(*args, v_scale=v_scale, codebook=codebook)
    tok = torch.arange(width, device=logits.device)[None, :]
    lens = kv_lens.to(torch.int64)[:, None]
    t = torch.minimum(tok, lens - 1)
    blocks = table_indices.to(torch.int64)[table_start.to(torch.int64)[:, None] + t // block_size]
    slots = blocks * block_size + t % block_size
    v = read_rows(v_cache, v_scale, codebook, slots, head_dim)  # [B, W, Hkv, D]
    v = v.repeat_interleave(num_qo_heads // num_kv_heads, dim=2)  # [B, W, Hq, D]
    probs = torch.exp(logits - logit_lse[..., None])  # -inf columns -> 0
    out.copy_(torch.einsum("bhw,bwhd->bhd", probs, v))
    return out
