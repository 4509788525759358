"""Scoring functions of the eviction family, as pure functions of tensors.

Shapes follow the engine's NHD layout: queries ``[n, num_q_heads, D]``, keys ``[L, num_kv_heads, D]``
(post-RoPE, slot order). Query heads ``h * g .. h * g + g - 1`` share KV head ``h`` (GQA, ``g``
query heads per KV head). Everything is computed in float32.

``window_scores`` and ``attention_column_sums`` batch all KV heads into one computation (a dozen
device ops per call however many heads), in head chunks of at most ``MAX_SCORE_ELEMENTS`` logits,
so a long prompt scored by many queries (chunked H2O) still falls back to a head at a time. Their
``*_reference`` twins are the plain per-head loops; tests hold them equal.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

Pooling = Literal["avg", "max", "none"]
GroupReduce = Literal["mean", "max", "sum"]


def _group_logits(queries: torch.Tensor, keys: torch.Tensor, head: int, scale: float) -> torch.Tensor:
    """Raw ``q.k * scale`` of KV head ``head``'s query group: ``[g, n, L]`` float32."""
    g = queries.shape[1] // keys.shape[1]
    q = queries[:, head * g : (head + 1) * g].float().transpose(0, 1)  # [g, n, D]
    k = keys[:, head].float()  # [L, D]
    return torch.matmul(q, k.T) * scale


def causal_probabilities(
    queries: torch.Tensor, keys: torch.Tensor, scale: float, query_slots: torch.Tensor, head: int
) -> torch.Tensor:
    """Softmax attention of KV head ``head``'s query group: ``[g, n, L]``.

    Query ``i`` sees the slots ``<= query_slots[i]``.
    """
    logits = _group_logits(queries, keys, head, scale)
    cols = torch.arange(keys.shape[0], device=keys.device)
    logits.masked_fill_(cols.view(1, 1, -1) > query_slots.view(1, -1, 1), float("-inf"))
    return torch.softmax(logits, dim=-1)


def pool_scores(scores: torch.Tensor, kernel_size: int, pooling: Pooling) -> torch.Tensor:
    """Smooth ``[..., M]`` scores along tokens (stride 1, padding ``kernel_size // 2``, same length).

    ``avg`` counts the zero padding (as ``F.avg_pool1d`` does by default), ``max`` ignores it.
    """
    if pooling == "none" or kernel_size <= 1 or scores.shape[-1] == 0:
        return scores
    if kernel_size % 2 == 0:
        raise ValueError(f"pooling kernel_size must be odd to keep the length, got {kernel_size}")
    lead = scores.shape[:-1]
    flat = scores.reshape(-1, 1, scores.shape[-1])
    if pooling == "avg":
        out = F.avg_pool1d(flat, kernel_size, stride=1, padding=kernel_size // 2)
    elif pooling == "max":
        out = F.max_pool1d(flat, kernel_size, stride=1, padding=kernel_size // 2)
    else:
        raise ValueError(f"unknown pooling {pooling!r}")
    return out.reshape(*lead, -1)


def _reduce(x: torch.Tensor, how: GroupReduce, dim: int) -> torch.Tensor:
    if how == "mean":
        return x.mean(dim)
    if how == "sum":
        return x.sum(dim)
    if how == "max":
        return x.amax(dim)
    raise ValueError(f"unknown reduction {how!r}")


MAX_SCORE_ELEMENTS = 1 << 27  # float32 logits per head chunk (512 MiB; softmax holds a second copy)


def _head_chunks(num_kv_heads: int, per_head: int) -> list[slice]:
    """KV head ranges of at most ``MAX_SCORE_ELEMENTS // per_head`` heads (at least one)."""
    step = max(1, min(num_kv_heads, MAX_SCORE_ELEMENTS // max(1, per_head)))
    return [slice(h, min(h + step, num_kv_heads)) for h in range(0, num_kv_heads, step)]


def _heads_logits(queries: torch.Tensor, keys: torch.Tensor, heads: slice, scale: float) -> torch.Tensor:
    """Raw ``q.k * scale`` of the query groups of KV heads ``heads``: ``[h, g, n, L]`` float32."""
    n, num_q_heads, d = queries.shape
    num_kv_heads = keys.shape[1]
    g = num_q_heads // num_kv_heads
    q = queries.reshape(n, num_kv_heads, g, d)[:, heads].float().permute(1, 2, 0, 3)  # [h, g, n, D]
    h = q.shape[0]
    k = keys[:, heads].float().permute(1, 2, 0)  # [h, D, L], read in place (no copy per query head)
    return torch.bmm(q.reshape(h, g * n, d), k).view(h, g, n, -1).mul_(scale)


def _heads_probabilities(
    queries: torch.Tensor, keys: torch.Tensor, heads: slice, scale: float, future: torch.Tensor
) -> torch.Tensor:
    """Causal softmax of KV heads ``heads``' query groups: ``[h, g, n, L]``; ``future`` ``[n, L]``
    marks the slots each query does not see."""
    logits = _heads_logits(queries, keys, heads, scale)
    logits.masked_fill_(future, float("-inf"))
    return torch.softmax(logits, dim=-1)


def _future(query_slots: torch.Tensor, num_keys: int) -> torch.Tensor:
    cols = torch.arange(num_keys, device=query_slots.device)
    return cols.view(1, -1) > query_slots.view(-1, 1)  # [n, L]


def window_scores(
    queries: torch.Tensor,
    keys: torch.Tensor,
    scale: float,
    *,
    query_slots: torch.Tensor,
    num_scored: int,
    score_mode: Literal["probability", "logits"] = "probability",
    kernel_size: int = 5,
    pooling: Pooling = "avg",
    group_reduce: GroupReduce = "mean",
) -> torch.Tensor:
    """SnapKV's observation-window scores of the first ``num_scored`` slots: ``[num_kv_heads, num_scored]``.

    ``probability``: causal softmax of the window queries over all keys, averaged over the window
    queries, pooled, then reduced over the query heads of each KV group (kvpress: mean).
    ``logits``: the raw ``q.k * scale``, maximum over window queries and over the group's heads,
    then pooled (``group_reduce`` is not used: the maximum is the reduction).
    All KV heads at once (see the module docstring); ``window_scores_reference`` loops over them.
    """
    if score_mode not in ("probability", "logits"):
        raise ValueError(f"unknown score_mode {score_mode!r}")
    n, num_q_heads, _ = queries.shape
    num_kv_heads, num_keys = keys.shape[1], keys.shape[0]
    g = num_q_heads // num_kv_heads
    length = num_keys if score_mode == "probability" else num_scored
    chunks = _head_chunks(num_kv_heads, g * n * length)
    future = _future(query_slots, num_keys) if score_mode == "probability" else None
    parts = []
    for heads in chunks:
        if score_mode == "probability":
            probs = _heads_probabilities(queries, keys, heads, scale, future)[..., :num_scored]  # [h, g, n, M]
            pooled = pool_scores(probs.mean(2), kernel_size, pooling)  # [h, g, M]
            parts.append(_reduce(pooled, group_reduce, 1))
        else:
            logits = _heads_logits(queries, keys[:num_scored], heads, scale)  # [h, g, n, M]
            parts.append(pool_scores(logits.amax(dim=(1, 2)), kernel_size, pooling))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def attention_column_sums(
    queries: torch.Tensor, keys: torch.Tensor, scale: float, *, query_slots: torch.Tensor
) -> torch.Tensor:
    """H2O's accumulated attention: ``[num_q_heads, L]``, column sums of each query head's causal
    softmax over the given queries (what each key received from them). All KV heads at once;
    ``attention_column_sums_reference`` loops over them."""
    n, num_q_heads, _ = queries.shape
    num_kv_heads, num_keys = keys.shape[1], keys.shape[0]
    g = num_q_heads // num_kv_heads
    future = _future(query_slots, num_keys)
    parts = [
        _heads_probabilities(queries, keys, heads, scale, future).sum(2).flatten(0, 1)  # [h * g, L]
        for heads in _head_chunks(num_kv_heads, g * n * num_keys)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def window_scores_reference(
    queries: torch.Tensor,
    keys: torch.Tensor,
    scale: float,
    *,
    query_slots: torch.Tensor,
    num_scored: int,
    score_mode: Literal["probability", "logits"] = "probability",
    kernel_size: int = 5,
    pooling: Pooling = "avg",
    group_reduce: GroupReduce = "mean",
) -> torch.Tensor:
    """``window_scores`` one KV head at a time (the plain reference of the batched computation)."""
    num_kv_heads = keys.shape[1]
    out = torch.empty(num_kv_heads, num_scored, dtype=torch.float32, device=keys.device)
    for h in range(num_kv_heads):
        if score_mode == "probability":
            probs = causal_probabilities(queries, keys, scale, query_slots, h)[..., :num_scored]  # [g, n, M]
            per_head = pool_scores(probs.mean(1), kernel_size, pooling)  # [g, M]
            out[h] = _reduce(per_head, group_reduce, 0)
        elif score_mode == "logits":
            logits = _group_logits(queries, keys[:num_scored], h, scale)  # [g, n, M]
            out[h] = pool_scores(logits.amax(dim=(0, 1)), kernel_size, pooling)
        else:
            raise ValueError(f"unknown score_mode {score_mode!r}")
    return out


def attention_column_sums_reference(
    queries: torch.Tensor, keys: torch.Tensor, scale: float, *, query_slots: torch.Tensor
) -> torch.Tensor:
    """``attention_column_sums`` one KV head at a time (the plain reference)."""
    g = queries.shape[1] // keys.shape[1]
    out = torch.empty(queries.shape[1], keys.shape[0], dtype=torch.float32, device=keys.device)
    for h in range(keys.shape[1]):
        out[h * g : (h + 1) * g] = causal_probabilities(queries, keys, scale, query_slots, h).sum(1)
    return out


def pyramid_budgets(mean_kept: int, window: int, kv_len: int, num_layers: int, beta: float = 20.0) -> list[int]:
    """PyramidKV's per-layer budgets (tokens kept per layer, window included), bottom layer largest.

    KVCache-Factory's shape with an average of ``C = mean_kept`` per layer: the top layer keeps
    ``lo = C / beta``, the bottom one ``hi = 2 C - lo`` (at most ``kv_len - window``, then ``lo``
    rises to keep the average), linear in between, rounded (float arithmetic, as kvpress). When the
    pyramid does not fit (``kv_len >= hi >= lo >= window`` fails, e.g. short contexts) or there is
    one layer, every layer keeps ``mean_kept``.
    """
    if beta < 1:
        raise ValueError(f"beta must be >= 1, got {beta}")
    lo = mean_kept / beta
    hi = mean_kept * 2 - lo
    if hi >= kv_len - window:
        hi = kv_len - window
        lo = mean_kept * 2 - hi
    if num_layers == 1 or not (kv_len >= hi >= lo >= window):
        return [mean_kept] * num_layers
    step = (hi - lo) / (num_layers - 1)
    return [round(hi - layer * step) for layer in range(num_layers)]


def window_scores_batch(
    queries: torch.Tensor,
    keys: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    *,
    score_mode: Literal["probability", "logits"] = "probability",
    kernel_size: int = 5,
    pooling: Pooling = "avg",
    group_reduce: GroupReduce = "mean",
) -> torch.Tensor:
    """``window_scores`` of ``B`` requests at once: ``[B, num_kv_heads, L - n]``.

    ``queries``: ``[B, n, num_q_heads, D]``, each request's ``n`` window queries (its last ``n`` slots);
    ``keys``: ``[B, L, num_kv_heads, D]``, each request's keys padded past its ``kv_lens[b]`` (int64
    ``[B]`` on the keys' device). Row ``b``'s first ``kv_lens[b] - n`` columns equal ``window_scores``
    of that request alone; the columns after them hold what pooling pads with (0, or ``-inf`` for a
    max over logits), never a score.
    """
    if score_mode not in ("probability", "logits"):
        raise ValueError(f"unknown score_mode {score_mode!r}")
    b, n, num_q_heads, d = queries.shape
    num_keys, num_kv_heads = keys.shape[1], keys.shape[2]
    g = num_q_heads // num_kv_heads
    cols = torch.arange(num_keys, device=keys.device)
    first_query = (kv_lens - n).view(b, 1)  # slot of each request's first window query
    q = queries.reshape(b, n, num_kv_heads, g, d).float().permute(0, 2, 3, 1, 4)  # [B, H, g, n, D]
    k = keys.float().permute(0, 2, 3, 1)  # [B, H, D, L]
    logits = torch.matmul(q.reshape(b, num_kv_heads, g * n, d), k).view(b, num_kv_heads, g, n, num_keys).mul_(scale)
    scored = (cols.view(1, -1) < first_query).view(b, 1, 1, -1)[..., : num_keys - n]  # [B, 1, 1, L - n]
    if score_mode == "probability":
        slots = first_query + torch.arange(n, device=keys.device).view(1, n)  # [B, n]
        future = cols.view(1, 1, -1) > slots.view(b, n, 1)  # [B, n, L]
        logits.masked_fill_(future.view(b, 1, 1, n, num_keys), float("-inf"))
        probs = torch.softmax(logits, dim=-1)[..., : num_keys - n].mean(3)  # [B, H, g, L - n]
        return reduce_window_probs(probs.masked_fill_(~scored, 0.0), kernel_size, pooling, group_reduce)
    pad = 0.0 if pooling == "avg" else float("-inf")
    best = logits[..., : num_keys - n].amax(dim=(2, 3))  # [B, H, L - n]
    return pool_scores(best.masked_fill(~scored.view(b, 1, -1), pad), kernel_size, pooling)


def reduce_window_probs(
    probs: torch.Tensor, kernel_size: int, pooling: Pooling, group_reduce: GroupReduce
) -> torch.Tensor:
    """``window_scores_batch``'s scores from the window's mean probabilities ``probs`` ``[B, H, g, M]`` (0
    past each request's scored slots; e.g. ``sparse_kernels.window_probs`` viewed per KV head's query
    group): pooled over tokens, reduced over the group, ``[B, H, M]``."""
    return _reduce(pool_scores(probs, kernel_size, pooling), group_reduce, 2)
