"""The KV pool: per-layer K and V tensors of fixed-size blocks, sized from the memory budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparse_models import ModelConfig


@dataclass(frozen=True, slots=True)
class KVPool:
    """``k[layer]`` and ``v[layer]``: [num_blocks, block_size, num_kv_heads, head_dim] (NHD)."""

    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor, ...]

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0]


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """KV bytes one block takes across all layers (K and V)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elem


def allocate_kv_pool(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device) -> KVPool:
    shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    k = tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers))
    v = tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers))
    return KVPool(k, v)


def num_blocks_for_budget(
    cfg: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int, cap: int | None = None
) -> int:
    """Blocks that fit in ``budget_bytes`` (at most ``cap``); an error when not even one fits."""
    n = budget_bytes // bytes_per_block(cfg, block_size, dtype)
    if cap is not None:
        n = min(n, cap)
    if n < 1:
        raise ValueError(
            f"no KV block fits: {budget_bytes / 2**20:.1f} MiB available, "
            f"{bytes_per_block(cfg, block_size, dtype) / 2**20:.2f} MiB per block"
        )
    return int(n)
