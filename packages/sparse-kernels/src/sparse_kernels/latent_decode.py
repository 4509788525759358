"""Decode over a latent (MLA) cache with a graph-safe ``run``: plan copies each step into fixed buffers.

``plan`` (host, once per step) stages the step's CSR into persistent device buffers (one pinned,
non-blocking copy) and fixes the launch from the batch size alone; ``run`` (device only, per layer)
launches the latent kernel over them. A ``run`` captured in a CUDA graph therefore replays any later
plan of the same batch size, provided the buffers did not move: pass ``max_batch_size`` and
``max_num_pages`` so they are allocated once, at the first plan.
"""

from __future__ import annotations

import torch

from sparse_kernels._backend import check_backend
from sparse_kernels._decode_buffers import DecodeBuffers
from sparse_kernels.latent_attention import LatentPlan, latent_attention, plan_latent


class BatchLatentDecode:
    """One query token per request against its listed pages of a latent cache.

    Parameters
    ----------
    device : torch.device or str
    num_heads, latent_dim, rope_dim, block_size : int
        Query heads, channels of ``c_kv`` and of ``k_rope`` in each cached row, tokens per block.
    max_batch_size, max_num_pages : int, optional
        Fixed capacities of the CSR buffers (requests, ``kv_indices`` entries); larger plans raise.
    backend : str
        ``"auto"``, ``"triton"`` or ``"reference"`` (see ``sparse_kernels._backend``).
    """

    def __init__(
        self,
        device: torch.device | str,
        *,
        num_heads: int,
        latent_dim: int,
        rope_dim: int,
        block_size: int,
        max_batch_size: int | None = None,
        max_num_pages: int | None = None,
        backend: str = "auto",
    ):
        self.device = torch.device(device)
        self.shape = dict(num_heads=num_heads, latent_dim=latent_dim, rope_dim=rope_dim, block_size=block_size)
        self.backend = check_backend(backend)
        self._buffers = DecodeBuffers(self.device, max_batch_size, max_num_pages, None)
        self.planned: LatentPlan | None = None

    def plan(
        self,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_last_len: torch.Tensor,
        *,
        sm_scale: float,
        tiles: dict[str, int] | None = None,
    ) -> LatentPlan:
        """Stage one decode step (host int32 CSR as ``plan_latent``'s, one list per request)."""
        batch = kv_indptr.numel() - 1
        qo_indptr = torch.arange(batch + 1, dtype=torch.int32)
        self.planned = plan_latent(
            qo_indptr, kv_indptr, kv_indices, kv_last_len,
            sm_scale=sm_scale, device=self.device, tiles=tiles, buffers=self._buffers, **self.shape,
        )  # fmt: skip
        return self.planned

    def run(self, q: torch.Tensor, cache: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``q [B, H, latent + rope]`` over ``cache [num_blocks, block_size, 1, latent + rope]`` ->
        ``[B, H, latent]`` (into ``out`` when given). Device-only on the Triton backend."""
        if self.planned is None:
            raise RuntimeError("plan a step before run")
        return latent_attention(q, cache, self.planned, out=out, backend=self.backend)
