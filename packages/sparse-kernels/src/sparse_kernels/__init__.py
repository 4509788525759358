"""sparse_kernels: attention and KV-cache kernels, Triton on GPU with a plain-torch reference for each.

Layouts: per-layer KV pool ``[num_blocks, block_size, num_kv_heads, head_dim]`` (NHD),
``slot = block_id * block_size + offset``; paged KV as int32 CSR (``kv_indptr``, ``kv_indices``,
``kv_last_len``) with FlashInfer's plan (host, once per step) / run (device, per layer) split.

Every entry point takes ``backend="auto" | "triton" | "reference"``: ``auto`` runs Triton on CUDA
tensors and the reference on CPU, unless the ``SPARSE_KERNELS_BACKEND`` environment variable names
another; ``triton`` on CPU tensors runs under Triton's interpreter (tests).
"""

from sparse_kernels._backend import BACKEND_ENV, resolve_backend
from sparse_kernels._quantized_run import rotate as rotate_quantized
from sparse_kernels.attention_reference import causal_attention
from sparse_kernels.block_summary import block_summary, block_upper_bound
from sparse_kernels.compact import compact_kv
from sparse_kernels.head_max_probs import head_max_probs
from sparse_kernels.kv_quant import (
    allocate_quantized_kv,
    decode_kivi_pages,
    decode_rows,
    dequantize_blocks,
    encode_kivi_pages,
    encode_rows,
    lloyd_max_codebook,
    pack_codes,
    turboquant_rotation,
    unpack_codes,
)
from sparse_kernels.kv_store import store_kv
from sparse_kernels.linear import linear
from sparse_kernels.logits_attention import logits_attention, logits_lse, softmax_stats
from sparse_kernels.merge_states import merge_states, merge_states_
from sparse_kernels.moe import fused_moe
from sparse_kernels.page_bounds import page_bounds
from sparse_kernels.paged_decode import BatchDecodeWithPagedKVCache
from sparse_kernels.paged_logits import paged_logits
from sparse_kernels.paged_prefill import BatchPrefillWithPagedKVCache
from sparse_kernels.quantized_compact import compact_quantized
from sparse_kernels.quantized_kv import QuantizedKV
from sparse_kernels.quantized_store import store_kv_quantized
from sparse_kernels.rms_norm import fused_add_rms_norm, rms_norm
from sparse_kernels.rope import Rotation, rope_qk, rope_store
from sparse_kernels.selection_entries import selection_entries
from sparse_kernels.settings import launch_settings
from sparse_kernels.silu_mul import silu_and_mul
from sparse_kernels.summary_update import update_block_summaries
from sparse_kernels.top_k_ascending import top_k_ascending
from sparse_kernels.window_scores import window_probs

__all__ = [
    "BACKEND_ENV",
    "BatchDecodeWithPagedKVCache",
    "BatchPrefillWithPagedKVCache",
    "block_summary",
    "block_upper_bound",
    "causal_attention",
    "compact_kv",
    "fused_add_rms_norm",
    "fused_moe",
    "head_max_probs",
    "launch_settings",
    "linear",
    "logits_attention",
    "logits_lse",
    "merge_states",
    "merge_states_",
    "page_bounds",
    "paged_logits",
    "resolve_backend",
    "rms_norm",
    "rope_qk",
    "rope_store",
    "Rotation",
    "selection_entries",
    "silu_and_mul",
    "softmax_stats",
    "store_kv",
    "top_k_ascending",
    "update_block_summaries",
    "window_probs",
    "allocate_quantized_kv",
    "decode_kivi_pages",
    "decode_rows",
    "dequantize_blocks",
    "encode_kivi_pages",
    "encode_rows",
    "lloyd_max_codebook",
    "pack_codes",
    "turboquant_rotation",
    "unpack_codes",
    "store_kv_quantized",
    "compact_quantized",
    "QuantizedKV",
    "rotate_quantized",
]
