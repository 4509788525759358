"""RMSNorm (Zhang & Sennrich 2019, https://arxiv.org/abs/1910.07467), optionally fused with the residual add."""

from __future__ import annotations

import torch
from torch import nn

from sparse_kernels import fused_add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dimension.

    The statistic is taken in fp32 and the result cast back before the weight multiplies it, the
    order HF uses, so bf16 outputs match it bit for bit on the reference path (CPU) and within a
    last-bit rounding on the fused Triton kernel (CUDA); see ``sparse_kernels.rms_norm``.

    ``forward(x, residual)`` is the pre-norm block's "add then norm" (vLLM's pattern): it returns
    ``(norm(x + residual), x + residual)``, so a decoder carries the residual stream from one
    sub-block into the next norm and the add never makes its own pass over the hidden state.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)
