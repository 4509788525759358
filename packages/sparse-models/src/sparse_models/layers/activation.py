"""SwiGLU's gate (Shazeer 2020, https://arxiv.org/abs/2002.05202)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for ``x = [gate | up]`` concatenated on the last dim: [..., 2I] -> [..., I]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
