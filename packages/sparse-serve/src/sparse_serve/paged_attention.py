"""The engine's attention backend: store the step's K/V in the pool, then attend over pages.

Plans both kernels once per step from the host metadata; each layer's ``forward`` is then
device-only. Single-token items go to the decode kernel, prefill chunks to the prefill kernel.
"""

from __future__ import annotations

import torch

from sparse_kernels import BatchDecodeWithPagedKVCache, BatchPrefillWithPagedKVCache, store_kv
from sparse_serve.kv_pool import KVPool
from sparse_serve.step_metadata import StepMetadata


class PagedAttention:
    """Implements ``sparse_models.AttentionBackend`` over a ``KVPool``."""

    def __init__(self, pool: KVPool, *, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int):
        self.pool = pool
        self.device = pool.k[0].device
        self.shape = dict(num_qo_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size)
        self.decode = BatchDecodeWithPagedKVCache(self.device)
        self.prefill = BatchPrefillWithPagedKVCache(self.device)
        self.slot_mapping: torch.Tensor | None = None
        self.num_decode_tokens = 0
        self.has_prefill = False
        self.sm_scale = head_dim**-0.5

    def plan(self, meta: StepMetadata, slot_mapping: torch.Tensor) -> None:
        """Prepare one step. ``slot_mapping`` is ``meta.slot_mapping`` already on the device."""
        self.slot_mapping = slot_mapping
        self.num_decode_tokens = meta.num_decode_tokens
        self.has_prefill = meta.num_prefill_requests > 0
        if meta.num_decode_tokens:
            self.decode.plan(
                meta.decode_kv_indptr,
                meta.decode_kv_indices,
                meta.decode_kv_last_len,
                sm_scale=self.sm_scale,
                **self.shape,
            )
        if self.has_prefill:
            self.prefill.plan(
                meta.prefill_qo_indptr,
                meta.prefill_kv_indptr,
                meta.prefill_kv_indices,
                meta.prefill_kv_last_len,
                causal=True,
                sm_scale=self.sm_scale,
                **self.shape,
            )

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        if abs(scale - self.sm_scale) > 1e-12 * self.sm_scale:
            raise ValueError(f"attention scale {scale} differs from the planned {self.sm_scale}")
        k_cache, v_cache = self.pool.k[layer_idx], self.pool.v[layer_idx]
        store_kv(k, v, k_cache, v_cache, self.slot_mapping)
        nd = self.num_decode_tokens
        if not self.has_prefill:
            return self.decode.run(q, k_cache, v_cache)
        if nd == 0:
            return self.prefill.run(q, k_cache, v_cache)
        out = torch.empty_like(q)  # both kernels write their rows in place: no concatenation copy
        self.decode.run(q[:nd], k_cache, v_cache, out=out[:nd])
        self.prefill.run(q[nd:], k_cache, v_cache, out=out[nd:])
        return out
