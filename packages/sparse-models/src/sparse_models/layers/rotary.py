"""Rotary position embedding (Su et al. 2021, https://arxiv.org/abs/2104.09864).

HF's "rotate_half" layout: a head vector is split into halves ``[x1 | x2]`` and frequency ``i``
rotates the pair ``(x1[i], x2[i])`` (not adjacent pairs as in the paper; the checkpoints' q/k
weights are permuted to match, so only this layout gives the right answer).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from sparse_kernels import Rotation
from sparse_kernels.rope import apply_rotary  # noqa: F401  (re-exported: the reference rotation)
from sparse_models.config import RopeScaling
from sparse_models.layers.norm import RMSNorm


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """``theta ** (-2i / D)`` for ``i < D/2``: [head_dim // 2] fp32."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta**exponents)


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1's context extension: slow only the low frequencies.

    Wavelengths shorter than ``original_max / high_freq_factor`` are kept (local order), longer than
    ``original_max / low_freq_factor`` are divided by ``factor`` (long range), and the band between
    blends the two linearly in ``original_max / wavelength``.
    """
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, blended, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin of every position up to ``max_position``, computed once in fp32.

    One instance serves all layers: the model hands it to each attention layer, which rotates its
    q and k with it. The table is a non-persistent buffer, so it never appears in a checkpoint;
    positions must be ``< max_position``.
    """

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: RopeScaling | None = None):
        super().__init__()
        inv_freq = default_inv_freq(head_dim, theta)
        if scaling is not None:
            inv_freq = llama3_inv_freq(inv_freq, scaling)
        angles = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [P, D/2]
        self.register_buffer("cos_sin", torch.cat((angles.cos(), angles.sin()), dim=-1), persistent=False)

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` by ``positions [T]`` (int64), after the per-head
        ``q_norm`` / ``k_norm`` when given (Qwen3). One fused kernel on CUDA, HF's sequence of ops on
        CPU (see ``sparse_kernels.rope``); returns new contiguous tensors."""
        return self.rotation(positions, q_norm, k_norm).apply(q, k)

    def rotation(
        self, positions: torch.Tensor, q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None
    ) -> Rotation:
        """What ``forward`` does to q and k, not done yet: an attention backend applies it, fused with storing
        the keys where it can (``sparse_kernels.rope_store``)."""
        if (q_norm is None) != (k_norm is None):
            raise ValueError("pass both q_norm and k_norm, or neither")
        if q_norm is None:
            return Rotation(positions, self.cos_sin)
        if q_norm.eps != k_norm.eps:
            raise ValueError(f"q_norm and k_norm must share eps, got {q_norm.eps} and {k_norm.eps}")
        return Rotation(positions, self.cos_sin, q_norm.weight, k_norm.weight, q_norm.eps)
