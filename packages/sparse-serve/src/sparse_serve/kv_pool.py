"""The KV pool: per-layer K and V tensors of fixed-size blocks, sized from the memory budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparse_models import ModelConfig


@dataclass(frozen=True, slots=True)
class KVPool:
    """``k[layer]`` and ``v[layer]``: [num_blocks, block_size, num_kv_heads, head_dim] (NHD).

    With block summaries, ``kmin[layer]`` / ``kmax[layer]``: [num_blocks, num_kv_heads, head_dim], the
    elementwise min / max of each block's keys (query-aware methods bound attention with them).
    """

    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor, ...]
    kmin: tuple[torch.Tensor, ...] | None = None
    kmax: tuple[torch.Tensor, ...] | None = None

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0]


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, summaries: bool = False) -> int:
    """KV bytes one block takes across all layers (K and V, plus min/max key summaries if kept)."""
    elem = torch.empty((), dtype=dtype).element_size()
    rows = 2 * block_size + (2 if summaries else 0)
    return rows * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * elem


def allocate_kv_pool(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device, summaries: bool = False
) -> KVPool:
    shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    layers = range(cfg.num_hidden_layers)
    # Kernels read only slots that were written. On CPU an uninitialised pool costs memory only as
    # it fills (the OS maps pages on first touch); on GPU it is zeroed, so padded graph rows read zeros.
    new = torch.empty if torch.device(device).type == "cpu" else torch.zeros
    k = tuple(new(shape, dtype=dtype, device=device) for _ in layers)
    v = tuple(new(shape, dtype=dtype, device=device) for _ in layers)
    if not summaries:
        return KVPool(k, v)
    summary = (num_blocks, cfg.num_key_value_heads, cfg.head_dim)
    kmin = tuple(torch.zeros(summary, dtype=dtype, device=device) for _ in layers)
    kmax = tuple(torch.zeros(summary, dtype=dtype, device=device) for _ in layers)
    return KVPool(k, v, kmin, kmax)


def num_blocks_for_budget(
    cfg: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    budget_bytes: int,
    cap: int | None = None,
    summaries: bool = False,
) -> int:
    """Blocks that fit in ``budget_bytes`` (at most ``cap``); an error when not even one fits."""
    n = budget_bytes // bytes_per_block(cfg, block_size, dtype, summaries)
    if cap is not None:
        n = min(n, cap)
    if n < 1:
        raise ValueError(
            f"no KV block fits: {budget_bytes / 2**20:.1f} MiB available, "
            f"{bytes_per_block(cfg, block_size, dtype, summaries) / 2**20:.2f} MiB per block"
        )
    return int(n)
