"""Shared builders for paged-attention tests: a shuffled block pool plus the contiguous truth."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from sparse_kernels import causal_attention


@dataclass
class PagedBatch:
    """One step's paged layout, its pool, and per-request contiguous K/V to check against."""

    qo_indptr: torch.Tensor  # int32 [B + 1]
    kv_indptr: torch.Tensor  # int32 [B + 1]
    kv_indices: torch.Tensor  # int32 [nnz]
    kv_last_len: torch.Tensor  # int32 [B]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]; unused slots hold NaN
    v_cache: torch.Tensor
    q: torch.Tensor  # [T, Hq, D]
    k_seqs: list[torch.Tensor]  # per request [kv_len, Hkv, D]
    v_seqs: list[torch.Tensor]

    def layout(self) -> dict[str, int]:
        """The head and block layout ``plan`` needs, read off the batch's own tensors."""
        _, block_size, num_kv_heads, head_dim = self.k_cache.shape
        return dict(num_qo_heads=self.q.shape[1], num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size)

    def plan_prefill(self, wrapper, **kwargs) -> None:
        wrapper.plan(self.qo_indptr, self.kv_indptr, self.kv_indices, self.kv_last_len, **self.layout(), **kwargs)

    def plan_decode(self, wrapper, **kwargs) -> None:
        wrapper.plan(self.kv_indptr, self.kv_indices, self.kv_last_len, **self.layout(), **kwargs)

    def reference(self, sm_scale: float | None = None, causal: bool = True) -> torch.Tensor:
        """Per-request oracle output, concatenated to ``[T, Hq, D]``."""
        outs = []
        for b, (k, v) in enumerate(zip(self.k_seqs, self.v_seqs, strict=True)):
            q = self.q[int(self.qo_indptr[b]) : int(self.qo_indptr[b + 1])].cpu()  # K/V truth lives on CPU
            outs.append(causal_attention(q, k, v, sm_scale=sm_scale, causal=causal))
        return torch.cat(outs)


def make_paged_batch(
    qo_lens: list[int],
    kv_lens: list[int],
    *,
    block_size: int,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    spare_blocks: int = 5,
) -> PagedBatch:
    """Build a batch whose blocks come in shuffled order from a larger NaN-filled pool.

    NaN in every slot no request owns makes any read outside the listed tokens poison the output.
    """
    gen = torch.Generator().manual_seed(seed)
    num_blocks = [-(-n // block_size) for n in kv_lens]
    pool_blocks = sum(num_blocks) + spare_blocks
    perm = torch.randperm(pool_blocks, generator=gen).to(torch.int32)
    shape = (pool_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    k_flat, v_flat = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    k_seqs, v_seqs, indices = [], [], []
    start = 0
    for n, nb in zip(kv_lens, num_blocks, strict=True):
        blocks = perm[start : start + nb].to(torch.int64)
        start += nb
        indices.append(blocks)
        slots = (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:n]
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        k_flat[slots], v_flat[slots] = k, v
        k_seqs.append(k)
        v_seqs.append(v)
    last_len = [n - (nb - 1) * block_size for n, nb in zip(kv_lens, num_blocks, strict=True)]
    return PagedBatch(
        qo_indptr=_indptr(qo_lens),
        kv_indptr=_indptr(num_blocks),
        kv_indices=torch.cat(indices).to(torch.int32),
        kv_last_len=torch.tensor(last_len, dtype=torch.int32),
        k_cache=k_cache,
        v_cache=v_cache,
        q=torch.randn(sum(qo_lens), num_qo_heads, head_dim, generator=gen).to(dtype),
        k_seqs=k_seqs,
        v_seqs=v_seqs,
    )


def awkward_lengths(batch: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """KV lengths cycling 1, 97, 300, random; queries alternate full-sequence and cached-prefix."""
    gen = torch.Generator().manual_seed(seed)
    kv_lens, qo_lens = [], []
    for b in range(batch):
        kv = [1, 97, 300, int(torch.randint(2, 300, (1,), generator=gen))][b % 4]
        kv_lens.append(kv)
        qo_lens.append(kv if b % 2 == 0 else int(torch.randint(1, kv + 1, (1,), generator=gen)))
    return qo_lens, kv_lens


def _indptr(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@pytest.fixture
def paged_batch() -> Callable[..., PagedBatch]:
    return make_paged_batch


@pytest.fixture
def lengths() -> Callable[..., tuple[list[int], list[int]]]:
    return awkward_lengths
