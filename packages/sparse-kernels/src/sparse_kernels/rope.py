"""Rotary position embedding (Su et al. 2021, https://arxiv.org/abs/2104.09864) on q and k in one
launch, optionally after Qwen3's per-head RMSNorm of q and k: Triton kernel + reference.

HF's "rotate_half" (neox) layout: a head vector is split into halves ``[x1 | x2]`` and frequency
``i`` rotates the pair ``(x1[i], x2[i])``. The angle table ``cos_sin [max_position, D]`` holds
``cos`` in its first half and ``sin`` in its second, in fp32; like HF, both are cast to q's dtype
before they multiply, and every product and sum is rounded to that dtype. The Triton kernel rounds
at the same points, so in bf16 it differs from the reference only through the head norm's fp32 sum
of squares (another reduction order) or fused multiply-adds (fp32 last bits).
"""

from __future__ import annotations

import torch

from sparse_kernels._backend import resolve_backend
from sparse_kernels.rms_norm import rms_norm_reference


def rope_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    *,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate every q and k head by its token's position, RMS-normalising each head first if weights given.

    Parameters
    ----------
    q, k : torch.Tensor
        ``[T, Hq, D]`` and ``[T, Hkv, D]``, same dtype; any token/head strides (e.g. views of a merged
        q/k/v projection), unit stride over ``D``. ``D`` even.
    positions : torch.Tensor
        int32/int64 ``[T]``, each token's position, ``< max_position``.
    cos_sin : torch.Tensor
        fp32 ``[max_position, D]``: ``cos`` of each position's angles, then ``sin``.
    q_weight, k_weight : torch.Tensor, optional
        ``[D]`` in q's dtype, the per-head RMSNorm weights (both or neither).
    eps : float
        The head norm's epsilon.
    backend : str
        ``"auto"`` (Triton on CUDA, reference on CPU; ``SPARSE_KERNELS_BACKEND`` overrides),
        ``"triton"`` or ``"reference"``.

    Returns
    -------
    ``(q_out [T, Hq, D], k_out [T, Hkv, D])``, new contiguous tensors in q's dtype.
    """
    _check(q, k, positions, cos_sin, q_weight, k_weight)
    if q.shape[0] and resolve_backend(backend, q.device) == "triton":
        from sparse_kernels._triton.rope import rope_qk_triton

        return rope_qk_triton(q, k, positions, cos_sin, q_weight, k_weight, eps)
    return rope_qk_reference(q, k, positions, cos_sin, q_weight, k_weight, eps)


def rope_qk_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch ``rope_qk``: HF's order of operations, bit for bit."""
    cos, sin = cos_sin[positions].chunk(2, dim=-1)  # [T, D/2] each
    if q_weight is not None:
        q, k = rms_norm_reference(q, q_weight, eps), rms_norm_reference(k, k_weight, eps)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, H, D]`` by per-token angles given as ``cos, sin [T, D/2]`` (computed in x's dtype)."""
    cos = cos.to(x.dtype).unsqueeze(1)  # [T, 1, D/2], broadcast over heads
    sin = sin.to(x.dtype).unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _check(q, k, positions, cos_sin, q_weight, k_weight) -> None:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[2] % 2:
        raise ValueError(f"q, k must be [T, Hq, D], [T, Hkv, D] with D even, got {list(q.shape)}, {list(k.shape)}")
    if q.dtype != k.dtype:
        raise ValueError(f"q and k must share a dtype, got {q.dtype} and {k.dtype}")
    if positions.shape != (q.shape[0],) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be int32/int64 [{q.shape[0]}], got {positions.dtype} {list(positions.shape)}")
    if cos_sin.dim() != 2 or cos_sin.shape[1] != q.shape[2] or cos_sin.dtype != torch.float32:
        got = f"{cos_sin.dtype} {list(cos_sin.shape)}"
        raise ValueError(f"cos_sin must be fp32 [max_position, {q.shape[2]}], got {got}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("pass both q_weight and k_weight, or neither")
    for w in (q_weight, k_weight):
        if w is not None and (w.shape != (q.shape[2],) or w.dtype != q.dtype):
            raise ValueError(f"q/k norm weights must be {q.dtype} [{q.shape[2]}], got {w.dtype} {list(w.shape)}")
