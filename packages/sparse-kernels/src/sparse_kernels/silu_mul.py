"""SwiGLU's gate (Shazeer 2020, https://arxiv.org/abs/2002.05202) over a merged gate/up projection:
Triton kernel + reference.

Rounding follows ``F.silu(gate) * up``: silu in fp32 rounded to the input dtype, then the product
rounded once. The Triton kernel rounds at the same points; its ``exp`` may differ from torch's in the
last fp32 bit, so bf16 outputs can differ in rare last-bit roundings.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sparse_kernels._backend import resolve_backend


def silu_and_mul(x: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]`` on the last dimension.

    Parameters
    ----------
    x : torch.Tensor
        ``[..., 2 * I]``, gate in the first half and up in the second (the merged projection's
        output; rows may be strided, the last dimension must have unit stride on the Triton path).
    backend : str
        ``"auto"`` (Triton on CUDA, reference on CPU; ``SPARSE_KERNELS_BACKEND`` overrides),
        ``"triton"`` or ``"reference"``.

    Returns
    -------
    ``[..., I]`` in ``x.dtype``, a new tensor.
    """
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"x must be [..., 2 * I], got {list(x.shape)}")
    if x.numel() and resolve_backend(backend, x.device) == "triton":
        from sparse_kernels._triton.silu_mul import silu_and_mul_triton

        return silu_and_mul_triton(x)
    return silu_and_mul_reference(x)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """Plain-torch ``silu_and_mul``."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
