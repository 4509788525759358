"""Batched decode attention over a paged KV cache: one query per request (plan/run, reference path)."""

from __future__ import annotations

import torch

from sparse_kernels._paged_plan import build_plan
from sparse_kernels._paged_validate import check_heads, check_paged_kv, check_sm_scale
from sparse_kernels._paged_wrapper import PagedAttentionWrapper


class BatchDecodeWithPagedKVCache(PagedAttentionWrapper):
    """Decode attention: request ``b``'s single query sits at its last position and sees all ``kv_len_b`` keys.

    The reference shares the prefill planner (a decode step is a prefill with ``qo_len = 1``); the
    Triton path will be split-K over the KV blocks behind the same interface.
    """

    def plan(
        self,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_last_len: torch.Tensor,
        *,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        sm_scale: float | None = None,
    ) -> None:
        """Validate the step's paged layout and build the device index tensors ``run`` will use.

        Parameters
        ----------
        kv_indptr : torch.Tensor
            int32 CPU ``[B + 1]``; request ``b``'s blocks are ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``.
        kv_indices : torch.Tensor
            int32 CPU ``[nnz]``, pool block ids in sequence order.
        kv_last_len : torch.Tensor
            int32 CPU ``[B]``, tokens used in each request's last block, in ``[1, block_size]``.
        num_qo_heads, num_kv_heads, head_dim, block_size : int
            Head layout (``num_qo_heads`` a multiple of ``num_kv_heads``) and pool block size.
        sm_scale : float, optional
            Softmax scale; ``head_dim ** -0.5`` by default.

        Raises
        ------
        ValueError
            On a malformed layout (see ``BatchPrefillWithPagedKVCache.plan``).
        """
        check_heads(num_qo_heads, num_kv_heads, head_dim, block_size)
        num_blocks, kv_lens = check_paged_kv(kv_indptr, kv_indices, kv_last_len, block_size)
        qo_indptr = torch.arange(kv_lens.numel() + 1, dtype=torch.int32)
        self._plan = build_plan(
            qo_indptr,
            kv_indptr,
            kv_indices,
            num_blocks,
            kv_lens,
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            causal=True,  # the one query is at the last position, so causal == full
            sm_scale=check_sm_scale(sm_scale, head_dim),
            max_tile_elements=self.max_tile_elements,
            device=self.device,
        )
