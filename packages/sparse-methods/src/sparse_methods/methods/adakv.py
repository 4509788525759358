"""AdaKV: SnapKV's scores with per-head adaptive budgets. A layer keeps ``H x budget`` tokens in all
(``budget`` = sink + keep + recent, ``H`` KV heads), chosen as the best scores of the flattened
head x token scores, so heads whose attention is concentrated give tokens to heads whose is spread;
each head keeps at least ``alpha_safeguard x budget`` tokens (its protected ones count towards it).

Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation" (arXiv:2407.11550);
kvpress's AdaKVPress(SnapKVPress, alpha_safeguard=0.2) is ``sink_keep_tokens=0,
recent_keep_tokens=observation_window_size=64, score_kernel_size=5, score_pooling="avg"`` with
``decode_keep_tokens = n_kept - 64``. It compresses once, after the prompt.

Memory: it declares the head-major store (``StoreKind.HEAD_MAJOR``): each KV head of a layer keeps its
own count of slots (``Compaction.head_counts``), so a compacted layer holds ``sum_h n_h = H x budget``
slots, and decode reads every slot each head holds. Its memory plan is SnapKV's (``budget`` per head on
average). Each rank would hold different block counts: no tensor parallelism with this store yet.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import torch
from pydantic import Field

from sparse_methods.base import Compaction, Storage, StoreKind
from sparse_methods.methods.snapkv import SnapKV, SnapKVConfig
from sparse_methods.ragged_heads import ragged_rows
from sparse_methods.registry import register


class AdaKVConfig(SnapKVConfig):
    alpha_safeguard: float = Field(
        0.2, ge=0.0, le=1.0, description="Least fraction of the average per-head budget every KV head keeps."
    )

    decode_eviction_interval: int = Field(
        0, ge=0, le=0, description="Always 0 (never): adakv compresses once, after the prompt."
    )


def adaptive_keep(
    scores: torch.Tensor, *, kv_len: int | Sequence[int], sink: int, recent: int, budget: int, alpha: float
) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Per-head adaptive selection of one layer: ``(keep, counts)`` (``ragged_rows``: ``keep`` ``[H, n_max]``,
    row ``h``'s first ``counts[h]`` entries its kept slots, ascending).

    ``scores``: ``[H, M]`` of slots ``0 .. M-1`` (``M >= kv_len - recent``). ``kv_len``: the slots every
    head holds, or per head (heads that already keep different counts; scores past them are ignored).
    Each head keeps its sink and recent slots and its top ``int(budget * alpha)`` (at least 1 when
    ``alpha > 0``; the protected slots count first); the other ``H x budget`` places go to the best
    remaining scores over all heads.
    """
    num_heads, device = scores.shape[0], scores.device
    lens = torch.tensor([kv_len] * num_heads if isinstance(kv_len, int) else list(kv_len), device=device)
    width = int(lens.max())
    pos = torch.arange(width, device=device)
    real = pos < lens[:, None]
    mid_hi = lens - torch.minimum(torch.full_like(lens, recent), lens - lens.clamp(max=sink))
    middle = (pos >= sink) & (pos < mid_hi[:, None])
    ranked = torch.full((num_heads, width), float("-inf"), device=device)
    m = min(width, scores.shape[1])
    ranked[:, :m] = scores[:, :m].float()
    full = torch.where(middle, ranked, float("inf")).masked_fill(~real, float("-inf"))
    n_safe = int(budget * alpha)
    if alpha > 0 and budget > 0:
        n_safe = max(1, n_safe)
    if n_safe:
        top = torch.zeros_like(real).scatter_(1, torch.topk(full, min(n_safe, width), dim=1).indices, True)
        full = full.masked_fill(top & real, float("inf"))
    places = min(num_heads * budget, int(lens.sum()))
    order = torch.sort(full.flatten(), descending=True, stable=True).indices[:places]
    kept = torch.zeros(num_heads * width, dtype=torch.bool, device=device)
    kept[order] = True
    return ragged_rows(kept.view(num_heads, width) & real)


@register
class AdaKV(SnapKV):
    name = "adakv"
    Config = AdaKVConfig
    # Ragged per-head budgets: memory is the sum of the heads' counts. Not MLA (one latent KV head: nothing
    # to share out), nor sliding windows (the head-major store has no windowed layers yet), nor tensor
    # parallel (ranks' heads would hold different block counts, under one scheduler for all).
    storage = Storage(StoreKind.HEAD_MAJOR)
    supports = frozenset()
    batches_compactions = False  # its adaptive selection shares each layer's places out per request

    def __init__(self, config, shape) -> None:
        super().__init__(config, shape)
        self._pending_counts: dict[Hashable, list[tuple[int, ...] | None]] = {}
        self._chosen: tuple[int, ...] | None = None

    # -- selection: the base's per-layer top-k, replaced by the adaptive one --------------------------
    def _select(self, scores: torch.Tensor | None, kv_len: int, budget: int) -> torch.Tensor:
        """Every shard's heads share the layer's places out; this shard keeps its heads' rows."""
        sink, recent = self.protected(budget)
        reduction = self.head_reduction
        keep, counts = adaptive_keep(
            reduction.gather(scores, 0),
            kv_len=kv_len,
            sink=sink,
            recent=recent,
            budget=budget,
            alpha=self.config.alpha_safeguard,
        )
        self._chosen = tuple(reduction.local(torch.tensor(counts), 0).tolist())
        return reduction.local(keep, 0)

    def _select_ragged(self, scores: torch.Tensor, head_lens: tuple[int, ...], budget: int) -> torch.Tensor:
        """A resumed chain's heads hold different counts: the same sharing out, over each head's slots."""
        sink, recent = self.protected(budget)
        keep, self._chosen = adaptive_keep(
            scores, kv_len=head_lens, sink=sink, recent=recent, budget=budget, alpha=self.config.alpha_safeguard
        )
        return keep

    def _observe_request(self, layer, request, view) -> None:
        self._chosen = None
        super()._observe_request(layer, request, view)
        if self._chosen is not None:
            self._pending_counts.setdefault(request.request_id, self._layers())[layer] = self._chosen

    def finish_step(self) -> Mapping[Hashable, Compaction]:
        counts, self._pending_counts = self._pending_counts, {}
        out = super().finish_step()
        return {rid: Compaction(c.keep, tuple(counts.get(rid, self._layers()))) for rid, c in out.items()}
