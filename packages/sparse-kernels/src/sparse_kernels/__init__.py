"""sparse_kernels: attention and KV-cache kernels (plain-torch references; Triton paths to follow).

Layouts: per-layer KV pool ``[num_blocks, block_size, num_kv_heads, head_dim]`` (NHD),
``slot = block_id * block_size + offset``; paged KV as int32 CSR (``kv_indptr``, ``kv_indices``,
``kv_last_len``) with FlashInfer's plan (host, once per step) / run (device, per layer) split.
"""

from sparse_kernels.attention_reference import causal_attention
from sparse_kernels.kv_store import store_kv
from sparse_kernels.paged_decode import BatchDecodeWithPagedKVCache
from sparse_kernels.paged_prefill import BatchPrefillWithPagedKVCache

__all__ = [
    "BatchDecodeWithPagedKVCache",
    "BatchPrefillWithPagedKVCache",
    "causal_attention",
    "store_kv",
]
