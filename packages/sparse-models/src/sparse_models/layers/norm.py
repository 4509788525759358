"""RMSNorm (Zhang & Sennrich 2019, https://arxiv.org/abs/1910.07467)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dimension.

    The statistic is taken in fp32 and the result cast back before the weight multiplies it, the
    order HF uses, so bf16 outputs match it bit for bit rather than within rounding.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
