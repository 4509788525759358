"""SnapKV-style observation-window probabilities over paged keys, without materializing the logits.

Each row ``b`` holds its last ``n`` queries (the observation window); window query ``j`` sits at slot
``kv_lens[b] - n + j`` and sees the slots up to it. Token ``t`` scores the mean over the window of
its causal softmax probability, ``out[b, hq, t] = mean_j softmax_t(scale * q_j . k_t)``, for the
tokens before the window (``t < kv_lens[b] - n``: every window query sees them) and 0 elsewhere.
The Triton path reads the keys through the block table twice (log-sum-exp, then probabilities) and
never holds the ``[B, Hq, n, L]`` logits; the reference gathers the keys and softmaxes in float32.
"""

from __future__ import annotations

import torch

from sparse_kernels._backend import resolve_backend


def window_probs(
    queries: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    *,
    max_len: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Mean causal attention probability each token receives from its row's window queries.

    Parameters
    ----------
    queries : torch.Tensor
        ``[B, n, num_qo_heads, head_dim]`` (float32, bfloat16 or float16), row ``b``'s window
        queries; query head ``hq`` reads KV head ``hq // (num_qo_heads // num_kv_heads)``.
    k_cache : torch.Tensor
        ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous (a layer's paged keys).
    block_table : torch.Tensor
        int32 ``[B, max_blocks]``: token ``t`` of row ``b`` is slot ``block_table[b, t // block_size]
        * block_size + t % block_size``; only the first ``ceil(kv_lens[b] / block_size)`` are read.
    kv_lens : torch.Tensor
        int32 or int64 ``[B]`` on the device, ``kv_lens[b] <= max_blocks * block_size``.
    scale : float
        The softmax scale.
    max_len : int, optional
        Columns of the output; ``max_blocks * block_size`` when not given.
    backend : str
        ``"auto"``, ``"triton"`` or ``"reference"`` (``sparse_kernels._backend``). Windows of more
        than ``MAX_WINDOW`` (128) queries always take the reference.

    Returns
    -------
    torch.Tensor
        float32 ``[B, num_qo_heads, max_len]``: ``out[b, hq, t] = mean_j softmax(scale * q[b, j, hq] .
        k_{b, s})_t`` over the slots ``s <= kv_lens[b] - n + j`` query ``j`` sees, for ``t < kv_lens[b]
        - n``; 0 for ``t >= kv_lens[b] - n`` (so a row with ``kv_lens[b] <= n`` is all 0).
    """
    batch, n, num_qo_heads, head_dim = queries.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if k_cache.dim() != 4 or k_cache.shape[3] != head_dim or num_qo_heads % num_kv_heads:
        raise ValueError(f"incompatible queries {list(queries.shape)} and k_cache {list(k_cache.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] != batch or kv_lens.shape != (batch,):
        raise ValueError(f"block_table must be [{batch}, max_blocks] and kv_lens [{batch}]")
    if n == 0:
        raise ValueError("the window needs at least one query")
    width = block_table.shape[1] * block_size if max_len is None else max_len
    out = torch.empty(batch, num_qo_heads, width, dtype=torch.float32, device=queries.device)
    if out.numel() == 0:
        return out
    if resolve_backend(backend, queries.device) == "triton":
        from sparse_kernels._triton.window_scores import MAX_WINDOW, window_probs_triton

        if n <= MAX_WINDOW:  # a longer window does not fit one query tile: the reference below
            return window_probs_triton(queries, k_cache, block_table, kv_lens, scale, out)
    return out.copy_(window_probs_reference(queries, k_cache, block_table, kv_lens, scale, width))


def window_probs_reference(
    queries: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    width: int,
) -> torch.Tensor:
    """``window_probs`` from the formula: gather each row's keys, mask, softmax in float32, average."""
    batch, n, num_qo_heads, head_dim = queries.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_qo_heads // num_kv_heads
    num_keys = block_table.shape[1] * block_size
    device = queries.device
    cols = torch.arange(num_keys, device=device)
    lens = kv_lens.to(torch.int64).view(batch, 1)
    t = torch.minimum(cols.view(1, -1), lens - 1).clamp(min=0)  # past a row: its last token (masked below)
    blocks = block_table.to(torch.int64).gather(1, t // block_size).clamp(min=0)
    keys = k_cache.view(-1, num_kv_heads, head_dim)[blocks * block_size + t % block_size]  # [B, L, Hkv, D]
    q = queries.float().view(batch, n, num_kv_heads, group, head_dim)
    logits = torch.einsum("bnhgd,blhd->bhgnl", q, keys.float()) * scale  # [B, Hkv, g, n, L]
    slots = lens - n + torch.arange(n, device=device).view(1, n)  # [B, n]: each window query's slot
    future = cols.view(1, 1, -1) > slots.view(batch, n, 1)  # [B, n, L]
    probs = torch.softmax(logits.masked_fill(future.view(batch, 1, 1, n, num_keys), float("-inf")), dim=-1)
    scored = cols.view(1, -1) < lens - n  # [B, L]; every window query sees these
    mean = probs.mean(3).masked_fill(~scored.view(batch, 1, 1, -1), 0.0).view(batch, num_qo_heads, num_keys)
    if width <= num_keys:
        return mean[..., :width]
    return torch.nn.functional.pad(mean, (0, width - num_keys))
