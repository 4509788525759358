"""What the paged attention wrappers share: construction, and ``run`` over the current plan."""

from __future__ import annotations

import torch

from sparse_kernels._paged_plan import PagedPlan
from sparse_kernels._paged_run import run_paged_attention

DEFAULT_MAX_TILE_ELEMENTS = 2**28


class PagedAttentionWrapper:
    """Base of the prefill and decode wrappers; subclasses provide ``plan``.

    Parameters
    ----------
    device : torch.device or str
        Device of the KV pool and queries; ``plan`` puts its index tensors there.
    max_tile_elements : int
        Cap on each tile's float32 working set (scores, probs, gathered K/V), in elements. Long or
        many requests are split into tiles of consecutive requests or query chunks to respect it.
    """

    def __init__(self, device: torch.device | str = "cpu", *, max_tile_elements: int = DEFAULT_MAX_TILE_ELEMENTS):
        if max_tile_elements < 1:
            raise ValueError(f"max_tile_elements must be positive, got {max_tile_elements}")
        self.device = torch.device(device)
        self.max_tile_elements = max_tile_elements
        self._plan: PagedPlan | None = None

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention for one layer, device-only.

        Parameters
        ----------
        q : torch.Tensor
            ``[T, num_qo_heads, head_dim]``: the planned query rows (one per request for decode).
        k_cache, v_cache : torch.Tensor
            ``[num_blocks, block_size, num_kv_heads, head_dim]`` (NHD), contiguous.
        out : torch.Tensor, optional
            Caller-owned buffer shaped like ``q``, in ``q``'s dtype.

        Returns
        -------
        torch.Tensor
            Shaped like ``q``, in ``q``'s dtype (softmax in float32).
        """
        if self._plan is None:
            raise RuntimeError("call plan(...) before run(...)")
        return run_paged_attention(self._plan, q, k_cache, v_cache, out)
