"""What the paged attention wrappers share: construction, backend choice and output checks."""

from __future__ import annotations

import torch

from sparse_kernels._backend import resolve_backend

DEFAULT_MAX_TILE_ELEMENTS = 2**28


class PagedAttentionWrapper:
    """Base of the prefill and decode wrappers; subclasses provide ``plan`` and ``run``.

    Parameters
    ----------
    device : torch.device or str
        Device of the KV pool and queries; ``plan`` puts its index tensors there.
    backend : str
        ``"auto"`` (Triton on CUDA, the reference on CPU; the ``SPARSE_KERNELS_BACKEND`` environment
        variable overrides ``auto``), ``"triton"`` (on CPU tensors it runs under Triton's interpreter:
        slow, for tests) or ``"reference"`` (plain torch). Resolved once, here.
    max_tile_elements : int
        Reference backend only: cap on each tile's float32 working set (scores, probs, gathered K/V),
        in elements. Long or many requests are split into tiles of consecutive requests or query
        chunks to respect it.
    """

    def __init__(
        self,
        device: torch.device | str = "cpu",
        *,
        backend: str = "auto",
        max_tile_elements: int = DEFAULT_MAX_TILE_ELEMENTS,
    ):
        if max_tile_elements < 1:
            raise ValueError(f"max_tile_elements must be positive, got {max_tile_elements}")
        self.device = torch.device(device)
        self.backend = resolve_backend(backend, self.device)
        self.max_tile_elements = max_tile_elements
        self._plan = None

    def _planned(self):
        if self._plan is None:
            raise RuntimeError("call plan(...) before run(...)")
        return self._plan


def output_buffer(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``out`` checked against ``q`` (shape, dtype, unit-stride last dim), or a new one like ``q``."""
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out must be {list(q.shape)} {q.dtype}, got {list(out.shape)} {out.dtype}")
    if out.numel() and out.stride(-1) != 1:
        raise ValueError("out's last dimension must be contiguous")
    return out
