"""Prefix-cache pruning: compress chosen ranges of an idle cached history into a degraded chain.

For an exact (radix) cache, an agent's old tool outputs can be compressed without touching the
rest of the history: each chosen range keeps its ``keep_tokens`` best tokens, every token outside
the ranges stays. The result is a new chain (its KV no longer matches its tokens one to one), so
only a request naming that chain resumes from it; the radix cache keeps the exact blocks, and a
request that did not ask for pruning never sees the pruned KV.

Policy ``snapkv_global`` (SnapKV's observation window, reduced to one mask for all layers and
heads): the ``observation_window_size`` queries right after a range are recomputed over the cached
KV before them (a scratch forward into scratch blocks; the cached blocks are only read), each
range token scores the attention probability those queries give it, summed over window queries,
query heads and layers, then max-pooled along tokens (kernel 7, as SnapKV) and the top
``keep_tokens`` are kept. Kept KV is the cached KV itself, copied to fresh blocks after the first
changed slot; the unchanged leading blocks are shared with the cache.

Policy ``kvzip_global`` (``prune_kvzip``): range tokens scored by KVzip's context reconstruction,
the ``keep_tokens`` best over all ranges together (one budget). Both score with a scratch forward
(``prune_scratch``); ``keep_tokens=0`` drops the ranges without scoring.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sparse_cache import SUMMARY_TENSORS, PrefixMatch, PruneRange, check_ranges, plan_prune
from sparse_kernels import block_summary
from sparse_methods import LayerAttention, ModelShape, PrefixCacheMode, RequestStep
from sparse_methods.scoring import causal_probabilities, pool_scores
from sparse_serve.prune_kvzip import kvzip_global_scores, top_over_ranges
from sparse_serve.prune_scratch import ScratchScorer, scratch_forward

if TYPE_CHECKING:
    from sparse_serve.engine import LLMEngine

PRUNE_POLICIES = ("snapkv_global", "kvzip_global")
_POOL_KERNEL = 7


class PruneError(ValueError):
    """A prune request the engine cannot carry out: ``code`` names the case, ``param`` the request field
    at fault (None for the engine's configuration), for API layers."""

    def __init__(self, message: str, code: str, param: str | None = None):
        super().__init__(message)
        self.code = code
        self.param = param


@dataclass(frozen=True, slots=True)
class PruneResult:
    """``chain_id``: the degraded chain holding the pruned history of ``num_tokens`` logical tokens
    in ``num_retained_tokens`` KV slots; ``kept[j]``: the positions kept inside range ``j``."""

    chain_id: str
    num_tokens: int
    num_retained_tokens: int
    kept: tuple[tuple[int, ...], ...]


class _WindowScorer(ScratchScorer):
    """Sums the attention that the queries at positions ``rows`` give to ``target`` positions, over
    query heads and layers."""

    def __init__(self, shape: ModelShape, target: PruneRange, rows: range):
        super().__init__(shape)
        self.target, self.rows, self.num_kv_heads = target, rows, shape.num_kv_heads
        self.scores = torch.zeros(len(target), dtype=torch.float32)

    def observe(self, layer: int, step: RequestStep, view: LayerAttention) -> None:
        lo, hi = max(self.rows.start, step.start), min(self.rows.stop, step.end)
        if lo >= hi:
            return
        q = view.queries[lo - step.start : hi - step.start]
        slots = torch.arange(lo, hi, device=view.keys.device)  # the scratch table is exact: slot = position
        for h in range(self.num_kv_heads):
            probs = causal_probabilities(q, view.keys, view.scale, slots, h)  # [g, n, L]
            self.scores += probs[..., self.target.start : self.target.end].sum((0, 1)).cpu()


def prune_history(
    engine: LLMEngine,
    token_ids: list[int],
    ranges: Sequence[tuple[int, int]],
    keep_tokens: int,
    *,
    policy: str = "snapkv_global",
    window: int = 32,
    kvzip_score_chunk_size: int = 2048,
    kvzip_prev_postfix_size: int = 64,
    chain_id: str | None = None,
) -> PruneResult:
    """Prune the cached history of ``token_ids`` (its leading full blocks in the radix cache).

    ``ranges``: [start, end) positions inside that cached history (``snapkv_global``: each followed
    by at least one token of ``token_ids``, whose ``window`` queries score it). ``snapkv_global``
    keeps ``keep_tokens`` tokens in each range, ``kvzip_global`` ``keep_tokens`` in all of them
    together (replays of ``kvzip_score_chunk_size`` tokens, hints of ``kvzip_prev_postfix_size``).
    Returns the new chain. Raises ``PruneError`` (a ValueError with a ``code`` and the request field
    at fault) when the method is not exact, nothing is cached, a range is past the cached blocks or
    the pool is too full; a chain id already in use raises the chain cache's ``ChainExistsError``.
    """
    _check_request(engine, policy, keep_tokens, window, kvzip_score_chunk_size, kvzip_prev_postfix_size)
    kv = engine.kv
    kv.chains.check_room(chain_id)  # before any work: the id is free and a chain record fits
    match = kv.cached_prefix(token_ids)
    if match.num_tokens == 0:
        raise PruneError(
            "no cached history of this prompt to prune (only full cached blocks can be pruned)",
            "prune_nothing_cached",
            "prompt",
        )
    try:
        checked = check_ranges(ranges, match.num_tokens)
    except ValueError as e:
        inside_prompt = _valid_ranges(ranges, len(token_ids))  # then only the cached part is too short
        code = "prune_range_not_cached" if inside_prompt else "invalid_value"
        raise PruneError(f"{e} (cached: the first {match.num_tokens} tokens)", code, "ranges") from None
    if policy == "snapkv_global" and checked[-1].end >= len(token_ids):
        raise PruneError(
            "each range needs at least one token after it whose queries score it", "invalid_value", "ranges"
        )
    kv.pool.acquire(match.block_ids)  # pin the history while scratch blocks are taken
    try:
        if keep_tokens == 0:
            kept = [[] for _ in checked]
        elif policy == "snapkv_global":
            kept = [_snapkv_kept(engine, token_ids, match, r, window, keep_tokens) for r in checked]
        else:
            kept = _kvzip_kept(
                engine, token_ids, match, checked, keep_tokens, kvzip_score_chunk_size, kvzip_prev_postfix_size
            )
        plan = plan_prune(match.num_tokens, checked, kept, kv.block_size)
        new_id, copies = kv.add_pruned_chain(chain_id, token_ids, match, plan, engine.num_layers)
        _copy_slots(engine, copies)
    finally:
        kv.pool.release(reversed(match.block_ids))
    return PruneResult(new_id, match.num_tokens, plan.num_retained, tuple(tuple(k) for k in kept))


def _check_request(engine: LLMEngine, policy: str, keep_tokens: int, window: int, chunk: int, prev: int) -> None:
    """The engine can prune, and the request's fields are valid (a ``PruneError`` naming the field if not)."""
    if policy not in PRUNE_POLICIES:
        raise PruneError(
            f"unknown prune policy {policy!r}; known: {', '.join(PRUNE_POLICIES)}", "invalid_value", "policy"
        )
    if engine.method.prefix_cache_mode is not PrefixCacheMode.RADIX or not engine.kv.enable_prefix_caching:
        raise PruneError(
            "pruning compresses the exact radix cache; it needs a radix method and prefix caching", "prune_unsupported"
        )
    if engine.kv.per_layer:
        raise PruneError(
            "pruning copies one table for every layer; this model keeps a table per layer (sliding windows)",
            "prune_unsupported",
        )
    if engine.config.tensor_parallel_size > 1:
        # Its scratch scorer runs the whole model's heads on each rank and sums over local heads only.
        raise PruneError("pruning does not run under tensor parallelism yet", "prune_unsupported")
    if engine.runner.kv.store.has_tail:
        raise PruneError(
            f"pruning moves single tokens; a {engine.runner.kv.store.describe()} store quantizes whole pages",
            "prune_unsupported",
        )
    if policy == "kvzip_global" and engine.tokenizer is None:
        raise PruneError(
            "kvzip_global's replay instruction needs a tokenizer; this model has none", "prune_unsupported"
        )
    if keep_tokens < 0:
        raise PruneError(f"keep_tokens must be >= 0, got {keep_tokens}", "invalid_value", "keep_tokens")
    if window < 1:
        raise PruneError(
            f"the observation window must be >= 1, got {window}", "invalid_value", "observation_window_size"
        )
    if chunk < 1:
        raise PruneError(f"the replay chunk must be >= 1, got {chunk}", "invalid_value", "kvzip_score_chunk_size")
    if prev < 0:
        raise PruneError(f"the replay hint must be >= 0, got {prev}", "invalid_value", "kvzip_prev_postfix_size")


def _snapkv_kept(
    engine: LLMEngine, token_ids: list[int], match: PrefixMatch, r: PruneRange, window: int, keep: int
) -> list[int]:
    """snapkv_global: the window rows after ``r``, recomputed over the cached KV before them, score it."""
    rows = range(r.end, min(r.end + window, len(token_ids)))
    scorer = _WindowScorer(engine.method.shape, r, rows)
    _scratch(engine, match, token_ids[: rows.stop], r.end, scorer)
    return _top_positions(pool_scores(scorer.scores, _POOL_KERNEL, "max"), r, keep)


def _kvzip_kept(
    engine: LLMEngine,
    token_ids: list[int],
    match: PrefixMatch,
    ranges: tuple[PruneRange, ...],
    keep: int,
    chunk: int,
    prev: int,
) -> list[list[int]]:
    """kvzip_global: every range scored by replays after the history up to the last range's end."""
    if keep >= sum(map(len, ranges)):
        return [list(range(r.start, r.end)) for r in ranges]
    r_max = ranges[-1].end
    scores = kvzip_global_scores(
        engine.method.shape,
        token_ids,
        ranges,
        lambda text: engine.tokenizer.encode(text, add_special_tokens=False),
        lambda ids, scorer: _scratch(engine, match, ids, r_max, scorer),
        chunk_size=chunk,
        prev_size=prev,
    )
    return top_over_ranges(scores, ranges, keep)


def _valid_ranges(ranges: Sequence[tuple[int, int] | PruneRange], num_tokens: int) -> bool:
    try:
        check_ranges(ranges, num_tokens)
    except ValueError:
        return False
    return True


def _top_positions(scores: torch.Tensor, r: PruneRange, keep: int) -> list[int]:
    """The ``keep`` best-scored positions of ``r``, ascending (ties go to the earlier position)."""
    order = torch.sort(scores, descending=True, stable=True).indices[: min(keep, len(r))]
    return sorted(int(i) + r.start for i in order)


def _take_blocks(engine: LLMEngine, n: int) -> list[int]:
    kv = engine.kv
    if n > kv.pool.num_free_blocks:
        kv.chains.reclaim(n)
    blocks = kv.pool.allocate(n)
    if blocks is None:
        raise PruneError(
            f"pruning needs {n} free KV blocks; the pool has {kv.pool.num_free_blocks} now", "prune_no_room"
        )
    return blocks


def _scratch(engine: LLMEngine, match: PrefixMatch, token_ids: list[int], reuse: int, scorer: ScratchScorer) -> None:
    """A scratch forward of ``token_ids`` that reads the cached full blocks before position ``reuse``
    in place and recomputes the rest into blocks lent from the pool."""
    bs = engine.kv.block_size
    cached = list(match.block_ids[: reuse // bs])
    scratch = _take_blocks(engine, -(-len(token_ids) // bs) - len(cached))
    try:
        scratch_forward(engine, cached, scratch, token_ids, scorer)
    finally:
        engine.kv.pool.release(reversed(scratch))


def _copy_slots(engine: LLMEngine, copies: list[tuple[int, int]]) -> None:
    """Copy the retained KV slots into the pruned table's fresh blocks (all layers), then summarize
    those blocks' keys where the store keeps summaries (query-aware methods)."""
    if not copies:
        return
    kv, bs = engine.runner.kv, engine.kv.block_size
    device = kv.device
    src = torch.tensor([s for s, _ in copies], dtype=torch.int64, device=device)
    dst = torch.tensor([d for _, d in copies], dtype=torch.int64, device=device)
    for layer in kv.layers:
        for name, cache in layer.items():  # per-token tensors: K/V, or codes and their per-token scales
            if name not in SUMMARY_TENSORS:
                flat = cache.view(-1, *cache.shape[2:])
                flat[dst] = flat[src]
    if kv.kmin is not None:
        # Destinations fill whole fresh blocks from their first slot on: count them per block.
        filled = Counter(d // bs for _, d in copies)
        ids = torch.tensor(list(filled), dtype=torch.int64, device=device)
        valid = torch.tensor(list(filled.values()), dtype=torch.int64, device=device)
        for layer in range(len(kv.k)):
            kmin, kmax, kscale = kv.summary(layer)
            block_summary(kv.k[layer], ids, valid, kmin, kmax, scale=kscale)
