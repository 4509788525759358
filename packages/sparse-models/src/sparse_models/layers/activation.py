"""SwiGLU's gate (Shazeer 2020, https://arxiv.org/abs/2002.05202)."""

from __future__ import annotations

import torch
from torch import nn

from sparse_kernels import silu_and_mul


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for ``x = [gate | up]`` concatenated on the last dim: [..., 2I] -> [..., I].

    One fused kernel on CUDA, ``F.silu(gate) * up`` on CPU (see ``sparse_kernels.silu_mul``).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
