"""Rotary position embedding (Su et al. 2021, https://arxiv.org/abs/2104.09864) on q and k in one
launch, optionally after Qwen3's per-head RMSNorm of q and k: Triton kernel + reference.

HF's "rotate_half" (neox) layout: a head vector is split into halves ``[x1 | x2]`` and frequency
``i`` rotates the pair ``(x1[i], x2[i])``. The angle table ``cos_sin [max_position, D]`` holds
``cos`` in its first half and ``sin`` in its second, in fp32; like HF, both are cast to q's dtype
before they multiply, and every product and sum is rounded to that dtype. The Triton kernel rounds
at the same points, so in bf16 it differs from the reference only through the head norm's fp32 sum
of squares (another reduction order) or fused multiply-adds (fp32 last bits).

``rope_store`` fuses the rotation with the KV store that follows it at every layer (``store_kv``: the
new keys and values into the paged pool, optionally the decode queries into a ring): one launch instead
of two. ``Rotation`` describes a rotation not applied yet, which the model hands to its attention backend.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sparse_kernels import kv_store
from sparse_kernels._backend import resolve_backend
from sparse_kernels.rms_norm import rms_norm_reference


class Rotation(NamedTuple):
    """A rotary embedding still to apply to q and k: ``rope_qk``'s arguments besides the heads.

    ``positions`` int32/int64 ``[T]``; ``cos_sin`` fp32 ``[max_position, D]``; ``q_weight`` / ``k_weight``
    the per-head RMSNorm weights ``[D]`` (both or neither) and ``eps`` their epsilon (see ``rope_qk``).
    """

    positions: torch.Tensor
    cos_sin: torch.Tensor
    q_weight: torch.Tensor | None = None
    k_weight: torch.Tensor | None = None
    eps: float = 1e-6

    def apply(self, q: torch.Tensor, k: torch.Tensor, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
        """``rope_qk(q, k, ...)`` with this rotation: ``(q_out, k_out)``, new contiguous tensors."""
        return rope_qk(
            q,
            k,
            self.positions,
            self.cos_sin,
            q_weight=self.q_weight,
            k_weight=self.k_weight,
            eps=self.eps,
            backend=backend,
        )


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


def rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rotation: Rotation,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    copy_into: torch.Tensor | None = None,
    copy_index: torch.Tensor | None = None,
    num_copy: int = 0,
    backend: str = "auto",
) -> torch.Tensor:
    """Rotate q and k, store the rotated keys and the values in the paged pool, return the rotated queries.

    Exactly the unfused chain, in one launch on the Triton backend::

        q_out, k_out = rotation.apply(q, k)
        store_kv(k_out, v, k_cache, v_cache, slot_mapping,
                 copy_rows=q_out[:num_copy], copy_into=copy_into, copy_index=copy_index)  # copy if num_copy
        return q_out

    Parameters
    ----------
    q, k, v : torch.Tensor
        ``[T, Hq, D]``, ``[T, Hkv, D]``, ``[T, Hkv, D]``, one dtype; any token/head strides (views of a
        merged q/k/v projection), unit stride over ``D``.
    rotation : Rotation
        Positions, angle table and optional per-head norm weights (see ``rope_qk``).
    k_cache, v_cache : torch.Tensor
        ``[num_blocks, block_size, Hkv, D]`` in q's dtype, contiguous; written in place.
    slot_mapping : torch.Tensor
        int32 ``[T]`` on the device; ``-1`` marks a padded token whose key and value are not stored.
    copy_into, copy_index, num_copy
        Both tensors with ``num_copy > 0``, or neither with ``num_copy == 0``: ``copy_into[copy_index[i]] =
        q_out[i]`` for ``i < num_copy <= T`` (``copy_into`` ``[R, Hq, D]`` contiguous in q's dtype,
        ``copy_index`` int64 ``[>= num_copy]`` on the device, distinct rows).
    backend : str
        ``"auto"`` (Triton on CUDA, reference on CPU; ``SPARSE_KERNELS_BACKEND`` overrides),
        ``"triton"`` or ``"reference"``.

    Returns
    -------
    ``q_out [T, Hq, D]``, a new contiguous tensor in q's dtype. No host sync on either path.
    """
    if not isinstance(rotation, Rotation):
        raise TypeError(f"rotation must be a sparse_kernels.Rotation, got {type(rotation).__name__}")
    positions, cos_sin, q_weight, k_weight, eps = rotation
    _check(q, k, positions, cos_sin, q_weight, k_weight)
    kv_store._check(k, v, k_cache, v_cache, slot_mapping)
    if not (v.dtype == k_cache.dtype == v_cache.dtype == q.dtype):
        raise ValueError(
            f"v, k_cache and v_cache must have q's dtype {q.dtype} (the pool stores the model dtype); "
            f"got {v.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if not isinstance(num_copy, int) or not 0 <= num_copy <= q.shape[0]:
        raise ValueError(f"num_copy must be an int in [0, {q.shape[0]}], got {num_copy!r}")
    if num_copy == 0 and (copy_into is not None or copy_index is not None):
        raise ValueError("copy_into and copy_index copy the first num_copy queries: pass num_copy > 0 with them")
    if q.stride(2) != 1:
        q = q.contiguous()  # what the kernel would read anyway; q_out has unit stride, as copy rows must
    copy_rows = q[:num_copy] if num_copy else None  # stands in for q_out[:num_copy] in the checks
    copy = kv_store._check_copy(copy_rows, copy_into, copy_index, q.shape[0])
    if q.shape[0] and resolve_backend(backend, q.device) == "triton":
        from sparse_kernels._triton.rope import rope_store_triton

        copy = (copy_into, copy_index, num_copy) if copy is not None else None
        args = (q, k, v, positions, cos_sin, q_weight, k_weight, eps, k_cache, v_cache, slot_mapping, copy)
        return rope_store_triton(*args)
    q_out, k_out = rotation.apply(q, k, backend="reference")
    copy_args = dict(copy_rows=q_out[:num_copy], copy_into=copy_into, copy_index=copy_index) if num_copy else {}
    kv_store.store_kv(k_out, v, k_cache, v_cache, slot_mapping, **copy_args, backend="reference")
    return q_out


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
