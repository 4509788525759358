"""Apply a method's compactions to the pool: kept slots move to the front of each layer's table.

The method decides what to keep (``sparse_methods.Compaction``); ``sparse_kernels.compact_kv``
moves the K/V rows (per KV head, since heads may keep different tokens; Triton on GPU, its
reference on CPU) and this reports each layer's new length. The caller then
shrinks the request's table, returning whole blocks to the pool.
"""

from __future__ import annotations

import torch

from sparse_kernels import compact_kv
from sparse_methods import Compaction
from sparse_serve.kv_pool import KVPool
from sparse_serve.step_metadata import table_slots


def apply_compaction(
    pool: KVPool, block_ids: list[int], kv_lens: list[int], compaction: Compaction, block_size: int
) -> list[int]:
    """Compact the layers named in ``compaction``; returns the new per-layer KV lengths."""
    if len(compaction.keep) != len(kv_lens):
        raise ValueError(f"compaction covers {len(compaction.keep)} layers, the model has {len(kv_lens)}")
    device = pool.k[0].device
    new_lens = list(kv_lens)
    slots_of: dict[int, torch.Tensor] = {}
    for layer, keep in enumerate(compaction.keep):
        if keep is None:
            continue
        kv_len = kv_lens[layer]
        if keep.numel() and (int(keep.max()) >= kv_len or int(keep.min()) < 0):
            raise ValueError(f"layer {layer}: kept index outside the layer's {kv_len} slots")
        if kv_len not in slots_of:
            slots_of[kv_len] = table_slots(block_ids, kv_len, block_size).to(device=device, dtype=torch.int32)
        compact_kv(pool.k[layer], pool.v[layer], slots_of[kv_len], keep.to(device))
        new_lens[layer] = keep.shape[1]
    return new_lens
