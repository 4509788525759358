"""The engine's attention over a latent store (multi-head latent attention, ``latent paged``).

An MLA model hands the backend absorbed queries ``[T, H, latent + rope]`` and the rows to cache
``[T, 1, latent + rope]`` (see ``sparse_models.models.deepseek``); this writes the rows into the
layer's pool tensor and runs ``sparse_kernels.latent_attention`` over each request's pages. Decode
items and prefill chunks go in one launch: the plan lists the decode items first, one query token
each, then the prefill chunks, as the step's flat token layout does.
"""

from __future__ import annotations

import torch

from sparse_kernels.latent_attention import LatentPlan, latent_attention, plan_latent, store_latent
from sparse_serve.step_metadata import LayerGroupMetadata, StepMetadata, to_device


class LatentPagedAttention:
    """Per layer group: the slot mapping and the latent kernel's plan of the current step."""

    def __init__(self, latent: tuple[torch.Tensor, ...], *, num_heads: int, latent_dim: int, block_size: int):
        self.latent = latent  # per layer [num_blocks, block_size, 1, latent_dim + rope_dim]
        self.device = latent[0].device
        self.num_heads = num_heads
        self.latent_dim = latent_dim
        self.rope_dim = latent[0].shape[-1] - latent_dim
        self.block_size = block_size
        self._slots: list[torch.Tensor] = []
        self._plans: list[LatentPlan] = []

    def plan(self, meta: StepMetadata, sm_scale: float) -> None:
        self._slots = [to_device(group.slot_mapping, self.device) for group in meta.groups]
        self._plans = [self._plan_group(group, meta, sm_scale) for group in meta.groups]

    def _plan_group(self, group: LayerGroupMetadata, meta: StepMetadata, sm_scale: float) -> LatentPlan:
        nd = meta.num_decode_tokens
        d_indptr, p_indptr = group.decode_kv_indptr, group.prefill_kv_indptr
        qo_indptr = torch.cat([torch.arange(nd + 1, dtype=torch.int32), group.prefill_qo_indptr[1:] + nd])
        kv_indptr = torch.cat([d_indptr[: nd + 1], p_indptr[1:] + d_indptr[nd]])
        return plan_latent(
            qo_indptr,
            kv_indptr,
            torch.cat([group.decode_kv_indices, group.prefill_kv_indices]),
            torch.cat([group.decode_kv_last_len[:nd], group.prefill_kv_last_len]),
            num_heads=self.num_heads,
            latent_dim=self.latent_dim,
            rope_dim=self.rope_dim,
            block_size=self.block_size,
            sm_scale=sm_scale,
            device=self.device,
        )

    def forward(self, layer_idx: int, group_idx: int, q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Store ``rows [T, 1, D]`` and attend ``q [T, H, D]``; returns ``[T, H, latent_dim]``."""
        cache = self.latent[layer_idx]
        store_latent(rows, cache, self._slots[group_idx])
        return latent_attention(q, cache, self._plans[group_idx])
