"""The scratch forward a prune policy scores with: tokens run over a cached history without changing it.

A scratch request reads the history's cached full blocks in place and writes everything after them
(a partial block of the history, then the policy's own tokens: a window, a replay) into scratch
blocks that the caller lends and takes back. Its table is exact (slot = position). A
``ScratchScorer`` (a dense ``SparseMethod``) watches that request's attention in every layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sparse_cache import BlockTable
from sparse_methods import (
    Category,
    LayerAttention,
    LayerAttentionBatch,
    MemoryPlan,
    MethodConfig,
    ModelShape,
    PrefixCacheMode,
    RequestStep,
    SparseMethod,
    StepContext,
)
from sparse_serve.paged_attention import PagedAttention
from sparse_serve.request import Request
from sparse_serve.sampling_params import SamplingParams
from sparse_serve.scheduler import ScheduledBatch
from sparse_serve.step_metadata import build_step_metadata, to_device

if TYPE_CHECKING:
    from sparse_serve.engine import LLMEngine

SCRATCH_ID = "__prune__"


class ScratchScorer(SparseMethod):
    """The method of a scratch forward: attention stays dense; subclasses read the scratch request's
    queries and keys in ``observe`` (its slots are its positions)."""

    name = "prune_scratch_scorer"
    category = Category.DENSE
    prefix_cache_mode = PrefixCacheMode.RADIX
    Config = MethodConfig

    def __init__(self, shape: ModelShape):
        super().__init__(MethodConfig(), shape)

    def memory_plan(self, prompt_len: int, max_new_tokens: int, chunk_size: int) -> MemoryPlan:
        raise NotImplementedError("a scratch scorer is never scheduled")

    def prepare_step(self, step: StepContext) -> frozenset[str]:
        return frozenset({SCRATCH_ID})

    def on_attention_end(self, layer: int, batch: LayerAttentionBatch) -> None:
        for step, view in batch:
            self.observe(layer, step, view)

    def observe(self, layer: int, step: RequestStep, view: LayerAttention) -> None:
        """The scratch request's ``view`` after ``layer``'s attention, for the chunk ``step`` runs."""
        raise NotImplementedError


def scratch_forward(
    engine: LLMEngine, cached_blocks: list[int], scratch_blocks: list[int], token_ids: list[int], scorer: ScratchScorer
) -> None:
    """Run ``token_ids`` from position ``len(cached_blocks) * block_size`` on (in chunks of the step's
    token budget): the positions before are the ``cached_blocks``' KV, read in place; the rest is
    written to ``scratch_blocks`` (enough for ``len(token_ids)`` positions in all)."""
    bs, cfg = engine.kv.block_size, engine.runner.model_config
    start, total = len(cached_blocks) * bs, len(token_ids)
    table = BlockTable(bs, [*cached_blocks, *scratch_blocks], total)
    attention = PagedAttention(
        engine.runner.kv,
        num_q_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        block_size=bs,
        method=scorer,
    )
    chunk, device = engine.config.max_num_batched_tokens, engine.runner.device
    for pos in range(start, total, chunk):
        n = min(chunk, total - pos)
        req = Request(SCRATCH_ID, token_ids, SamplingParams(), 0, kv_lens=[pos] * engine.num_layers)
        req.num_computed_tokens, req.prefill_len = pos, total
        meta = build_step_metadata(ScheduledBatch(((req, n),)), lambda _: table, bs)
        attention.plan(meta, scorer.prepare_step(StepContext(meta.steps)))
        with torch.inference_mode():
            engine.runner.model(to_device(meta.input_ids, device), to_device(meta.positions, device), attention)
