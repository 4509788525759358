"""AdaKV: SnapKV's scores with per-head adaptive budgets. A layer keeps ``H x budget`` tokens in all
(``budget`` = sink + keep + recent, ``H`` KV heads), chosen as the best scores of the flattened
head x token scores, so heads whose attention is concentrated give tokens to heads whose is spread;
each head keeps at least ``alpha_safeguard x budget`` tokens (its protected ones count towards it).

Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation" (arXiv:2407.11550);
kvpress's AdaKVPress(SnapKVPress, alpha_safeguard=0.2) is ``sink_keep_tokens=0,
recent_keep_tokens=observation_window_size=64, score_kernel_size=5, score_pooling="avg"`` with
``decode_keep_tokens = n_kept - 64``. It compresses once, after the prompt.

Memory: today's store gives every KV head of a layer the same slots, so a compacted layer holds
``max_h(n_h) x H`` slots, not ``sum_h n_h``. A head with fewer tokens than the largest one keeps its
own tokens plus filler slots (its next-best tokens) that it never attends to: decode reads each head's
own tokens only (``head_masks``: per-head slot lists through ``decode_selection``). The memory plan reserves the
largest ``max_h(n_h)`` the budgets allow (one head takes everything the safeguard leaves), so
admission holds whatever the scores turn out to be. A chain's next turn prefills over every slot
(fillers included): prefill selections are shared by all KV heads.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import torch
from pydantic import Field

from sparse_methods.base import Compaction, DecodeView, LayerPlan, MemoryPlan, RequestStep, Selection, Support
from sparse_methods.head_masks import HeadMasks, ragged_keep
from sparse_methods.methods.snapkv import SnapKV, SnapKVConfig
from sparse_methods.registry import register


class AdaKVConfig(SnapKVConfig):
    alpha_safeguard: float = Field(
        0.2, ge=0.0, le=1.0, description="Least fraction of the average per-head budget every KV head keeps."
    )

    decode_eviction_interval: int = Field(
        0, ge=0, le=0, description="Always 0 (never): adakv compresses once, after the prompt."
    )


def adaptive_keep(
    scores: torch.Tensor, *, kv_len: int, sink: int, recent: int, budget: int, alpha: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head adaptive selection of one layer: ``(keep, valid)``, both ``[H, n_max]``.

    ``scores``: ``[H, M]`` of slots ``0 .. M-1`` (``M >= kv_len - recent``). Each head keeps its
    sink and recent slots and its top ``int(budget * alpha)`` (at least 1 when ``alpha > 0``; the
    protected slots count first); the other ``H x budget`` places go to the best remaining scores
    over all heads. ``keep[h]`` ascending holds head ``h``'s kept slots and, where it keeps fewer
    than the largest head, its next-best slots as fillers (``valid[h]`` False there).
    """
    num_heads = scores.shape[0]
    full = torch.full((num_heads, kv_len), float("inf"), dtype=torch.float32, device=scores.device)
    mid_hi = kv_len - min(recent, kv_len - min(sink, kv_len))
    full[:, sink:mid_hi] = scores[:, sink:mid_hi].float()
    n_safe = int(budget * alpha)
    if alpha > 0 and budget > 0:
        n_safe = max(1, n_safe)
    if n_safe:
        top = torch.topk(full, min(n_safe, kv_len), dim=1).indices
        full.scatter_(1, top, float("inf"))
    order = torch.sort(full.flatten(), descending=True, stable=True).indices[: num_heads * min(budget, kv_len)]
    kept = torch.zeros(num_heads * kv_len, dtype=torch.bool, device=scores.device)
    kept[order] = True
    return ragged_keep(kept.view(num_heads, kv_len), full)


@register
class AdaKV(SnapKV):
    name = "adakv"
    Config = AdaKVConfig
    # Not MLA (one latent KV head: nothing to share out) nor sliding windows (its per-head masks and memory
    # plan do not skip windowed layers yet); tensor parallel: the shards' scores are gathered and shared out.
    supports = frozenset({Support.TENSOR_PARALLEL})

    def __init__(self, config, shape) -> None:
        super().__init__(config, shape)
        self.masks = HeadMasks(shape.num_layers)
        self._pending_valid: dict[Hashable, list[torch.Tensor | None]] = {}
        self._chosen: torch.Tensor | None = None

    def max_head_tokens(self, prompt_len: int) -> int:
        """Most slots one head can end up with: its safeguard plus every place the others leave."""
        c, h = self.config, self.head_reduction.num_kv_heads(self.shape)
        budget = c.sink_keep_tokens + c.decode_keep_tokens + c.recent_keep_tokens
        floor = max(c.sink_keep_tokens + c.recent_keep_tokens, int(budget * c.alpha_safeguard))
        return min(prompt_len, budget + (h - 1) * max(0, budget - floor))

    def memory_plan(self, prompt_len: int, max_new_tokens: int, chunk_size: int) -> MemoryPlan:
        kept = min(prompt_len, self.max_head_tokens(prompt_len))
        return MemoryPlan.uniform(self.shape.num_layers, prompt_len, kept, kept + max_new_tokens)

    # -- selection: the base's per-layer top-k, replaced by the adaptive one --------------------------
    def _select(self, scores: torch.Tensor | None, kv_len: int, budget: int) -> torch.Tensor:
        """Every shard's heads share the layer's places out; this shard keeps its heads' rows (as wide as
        the largest head of every shard, so every rank compacts to the same slots)."""
        sink, recent = self.protected(budget)
        reduction = self.head_reduction
        keep, chosen = adaptive_keep(
            reduction.gather(scores, 0),
            kv_len=kv_len,
            sink=sink,
            recent=recent,
            budget=budget,
            alpha=self.config.alpha_safeguard,
        )
        self._chosen = chosen  # every shard's rows (``finish_step`` stores this shard's)
        return reduction.local(keep, 0)

    def on_attention_end(self, layer, request, view) -> None:
        self._chosen = None
        super().on_attention_end(layer, request, view)
        if self._chosen is not None:
            self._pending_valid.setdefault(request.request_id, self._layers())[layer] = self._chosen

    def finish_step(self) -> Mapping[Hashable, Compaction]:
        for rid, layers in self._pending_valid.items():
            for layer, valid in enumerate(layers):
                if valid is not None:
                    self.masks.set(rid, layer, valid, self.head_reduction)
        self._pending_valid = {}
        return super().finish_step()

    # -- decode: each head reads its own slots -------------------------------------------------------
    def layer_plan(self, layer: int) -> LayerPlan:
        return self.masks.layer_plan(layer)

    def decode_selection(self, layer: int, request: RequestStep, view: DecodeView) -> Selection | None:
        return self.masks.selection(request.request_id, layer, view.kv_len)

    # -- request events and chains -------------------------------------------------------------------
    def release(self, request_id: Hashable) -> object | None:
        return (super().release(request_id), self.masks.pop(request_id))

    def restore_state(self, request_id: Hashable, state: object) -> None:
        if state is not None:
            base, valid = state
            super().restore_state(request_id, base)
            if valid is not None:
                self.masks.restore(request_id, valid)
