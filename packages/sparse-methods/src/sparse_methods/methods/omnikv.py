"""OmniKV: a few "filter" layers attend to every token and choose, per request, one token set that
the layers after them (until the next filter layer) read; nothing is evicted (token-exact KV,
radix prefix cache), so a later step's filter can choose differently.

At a filter layer the decode query's raw ``q.k`` over the layer's keys is turned into a
distribution per query head (softmax over the candidates) and reduced by the maximum over heads;
the set is the sink, the best ``decode_keep_tokens`` and the recent tokens (recent = the newest
tokens, generated ones included), shared by all KV heads. Layers before the first filter layer and
the filter layers themselves read everything; contexts within the budget stay dense.
``full_attention_layers="auto"`` places filters at about 1/16, 1/4 and 9/16 of the depth (layers
2, 8 and 18 of a 32-layer model, the paper's Llama-3-8B choice).

``prefill_sparse_method="omnikv_prefill"`` (SE) applies the same structure to prefill chunks: at a
filter layer the chunk's queries score the history by raw ``q.k`` averaged over the chunk's queries,
maximum over heads, and the following layers let the chunk read only the ``prefill_sink_tokens``,
best ``prefill_keep_tokens`` and last ``prefill_recent_tokens`` of the history, plus the chunk
itself (causally).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Literal

import torch
from pydantic import Field, field_validator

from sparse_methods._kernels import kernels
from sparse_methods.base import (
    DENSE_LAYER,
    Category,
    DecodeBatch,
    DecodeRead,
    LayerPlan,
    MemoryPlan,
    MethodConfig,
    PrefillView,
    PrefixCacheMode,
    RequestStep,
    Selection,
    SparseMethod,
    Support,
    Unit,
)
from sparse_methods.keep_selection import keep_indices
from sparse_methods.registry import register, register_prefill_method


class OmniKVConfig(MethodConfig):
    sink_keep_tokens: int = Field(64, ge=0, description="Leading tokens always read, in tokens.")
    decode_keep_tokens: int = Field(4096, ge=0, description="Tokens the filter layers select, in tokens.")
    recent_keep_tokens: int = Field(512, ge=1, description="Most recent tokens always read, in tokens.")
    full_attention_layers: str = Field(
        "auto", description="Comma-separated filter layers (full attention + selection), or `auto`."
    )
    prefill_sparse_method: Literal["omnikv_prefill"] | None = Field(
        None, description="`omnikv_prefill`: prefill chunks after a filter layer read a selected history."
    )
    prefill_sink_tokens: int = Field(8, ge=0, description="omnikv_prefill: leading history tokens read.")
    prefill_keep_tokens: int = Field(4096, ge=0, description="omnikv_prefill: best-scored history tokens read.")
    prefill_recent_tokens: int = Field(128, ge=0, description="omnikv_prefill: last history tokens read.")

    @field_validator("full_attention_layers")
    @classmethod
    def _layers(cls, value: str) -> str:
        if value != "auto" and not all(part.strip().isdigit() for part in value.split(",")):
            raise ValueError(f"full_attention_layers must be `auto` or comma-separated layer indices, got {value!r}")
        return value


def auto_filter_layers(num_layers: int) -> list[int]:
    """Filter layers at about 1/16, 1/4 and 9/16 of the depth (2, 8, 18 for 32 layers)."""
    return sorted({min(num_layers - 1, round(num_layers * f)) for f in (1 / 16, 1 / 4, 9 / 16)})


def prefill_history_scores(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``[history_len]``: raw ``q.k`` averaged over the chunk's queries, then the maximum over heads."""
    g = queries.shape[1] // keys.shape[1]
    mean_q = queries.float().mean(0)  # [Hq, D]: the mean of q.k over queries is q-mean . k
    k = keys.float().repeat_interleave(g, dim=1)  # [L, Hq, D]
    return torch.einsum("hd,lhd->hl", mean_q, k).amax(0)


register_prefill_method("omnikv_prefill", for_methods=frozenset({"omnikv"}))


@register
class OmniKV(SparseMethod):
    name = "omnikv"
    category = Category.QUERY_AWARE_SELECTION
    prefix_cache_mode = PrefixCacheMode.RADIX
    Config = OmniKVConfig
    supports = frozenset({Support.TENSOR_PARALLEL})  # the max over heads is the max over the shards' maxima

    def __init__(self, config: OmniKVConfig, shape) -> None:
        super().__init__(config, shape)
        layers = config.full_attention_layers
        self.filter_layers = (
            auto_filter_layers(shape.num_layers) if layers == "auto" else sorted({int(x) for x in layers.split(",")})
        )
        if self.filter_layers[-1] >= shape.num_layers:
            raise ValueError(f"full_attention_layers {self.filter_layers} beyond the model's {shape.num_layers} layers")
        self._plans = tuple(self._plan(layer) for layer in range(shape.num_layers))
        self._history: dict[Hashable, torch.Tensor | None] = {}  # request -> history chosen for its chunk
        self._device_set: torch.Tensor | None = None  # [B, budget] tokens of this step's last filter layer

    @property
    def budget(self) -> int:
        c = self.config
        return c.sink_keep_tokens + c.decode_keep_tokens + c.recent_keep_tokens

    def memory_plan(self, prompt_len: int, max_new_tokens: int, chunk_size: int) -> MemoryPlan:
        return MemoryPlan.uniform(self.shape.num_layers, prompt_len, prompt_len, prompt_len + max_new_tokens)

    def _plan(self, layer: int) -> LayerPlan:
        """Layers before the first filter read everything; a filter layer reads everything and picks the set
        (from its keys) that the next layers read, in decode and, with ``omnikv_prefill``, in prefill."""
        if layer < self.filter_layers[0]:
            return DENSE_LAYER
        prefill = self.config.prefill_sparse_method == "omnikv_prefill"
        if layer in self.filter_layers:
            return LayerPlan(DecodeRead.OBSERVED, True, prefill, prefill, Unit.SLOT)
        return LayerPlan(DecodeRead.SELECTED, prefill=prefill, unit=Unit.SLOT)

    def layer_plan(self, layer: int) -> LayerPlan:
        return self._plans[layer]

    # -- decode (the only path, any device): the filter layer picks every row's set; the next layers read it --
    def selection_size(self, kv_len: int, page_size: int) -> int | None:
        return self.budget if kv_len > self.budget else None

    def select_decode(self, layer: int, batch: DecodeBatch) -> torch.Tensor | None:
        if layer in self.filter_layers:
            self._observe(batch)
            return None
        chosen = self._device_set
        if chosen is None or chosen.shape[0] != batch.query.shape[0]:
            raise RuntimeError("omnikv: a selecting layer ran before its filter layer")
        return chosen[:, None, :].expand(-1, self.shape.num_kv_heads, -1)

    def _observe(self, batch: DecodeBatch) -> None:
        """Every row's token set at a filter layer: per query head the softmax of ``q.k * scale`` over
        the row's tokens (logits read through the tables by ``sparse_kernels.paged_logits``, or the
        batch's own when the engine computed them), the max over heads with sink and recent forced in
        (``head_max_probs``), then the top ``budget`` in token order (``top_k_ascending``: ties to the
        earlier token). Rows must be over the budget."""
        c = self.config
        k = kernels()
        query = batch.query
        width = batch.max_pages * batch.block_size
        logits, logit_lse = batch.logits, batch.logit_lse
        if logits is None:
            shape = (query.shape[0], query.shape[1])
            logits = torch.empty(*shape, width, dtype=torch.float32, device=query.device)
            k.paged_logits(
                query,
                batch.key_cache,
                batch.table_indices,
                batch.table_start,
                batch.kv_lens,
                logits,
                scale=batch.sm_scale,
            )
            logit_lse = k.logits_lse(logits)
        scores = torch.empty(query.shape[0], width, dtype=torch.float32, device=query.device)
        k.head_max_probs(logits, logit_lse, batch.kv_lens, scores, sink=c.sink_keep_tokens, recent=c.recent_keep_tokens)
        scores = self.head_reduction.max(scores)
        self._device_set = k.top_k_ascending(scores, min(self.budget, width))

    @property
    def prefill_budget(self) -> int:
        c = self.config
        return c.prefill_sink_tokens + c.prefill_keep_tokens + c.prefill_recent_tokens

    def prefill_selection(self, layer: int, request: RequestStep, view: PrefillView) -> Selection | None:
        """A filter layer reads the whole history and stores the set for the layers after it (None when
        the history fits the prefill budget); other layers read the stored set."""
        c = self.config
        rid = request.request_id
        if layer in self.filter_layers:
            self._history[rid] = None
            if view.history_len > self.prefill_budget:
                scores = self.head_reduction.max(prefill_history_scores(view.queries, view.keys))
                self._history[rid] = keep_indices(
                    scores.view(1, -1),
                    kv_len=view.history_len,
                    sink=c.prefill_sink_tokens,
                    recent=c.prefill_recent_tokens,
                    num_middle=c.prefill_keep_tokens,
                )[0]
            return None
        chosen = self._history.get(rid)
        if chosen is None:
            return None
        return Selection(chosen.view(1, -1).expand(self.shape.num_kv_heads, -1), 1)

    def release(self, request_id: Hashable) -> None:
        self._history.pop(request_id, None)
