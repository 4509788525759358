"""Decode projections that also do the pre-norm block's residual add, RMSNorm and SiLU gate.

In a pre-norm decoder (Llama and kin) the hidden state ``h`` leaves each sub-block through a
projection plus a residual add (o, down), and enters the next through an RMSNorm into a projection
(qkv, gate/up), whose MLP output goes through ``silu(gate) * up``. At decode each of those glue steps
is its own launch of a few microseconds between weight streams. Here they ride in the projections'
epilogues, with nothing added to the weight stream itself:

- ``linear_add_norm``: ``h = x W^T + b + residual``, and for the next norm ``h * g`` and the sums of
  squares of ``h`` per row (one partial per column tile of the kernel: ``NormedHidden``).
- ``linear_normed``: ``norm(h) W^T + b``, using ``norm(h) W^T = rsqrt(mean(h^2) + eps) * ((h * g) W^T)``:
  the row scale is applied to the product in the epilogue, from the partial sums; ``gated`` returns
  ``silu(gate) * up`` of a merged ``[gate; up]`` weight instead.

Rounding differs from the unfused chain (HF rounds ``h * rsqrt(..)`` to bf16 before ``g`` multiplies
it; here ``h * g`` is rounded and the scale meets the fp32 product), so outputs agree within bf16 ulps,
not bit for bit: the model uses these only where the Triton kernels run (CUDA decode batches of at most
``SMALL_M_MAX`` rows), and keeps the unfused, HF-exact path elsewhere. ``backend="reference"`` is the
plain torch formula the kernel is tested against.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

from sparse_kernels._backend import check_backend
from sparse_kernels.linear import _AUTO_DTYPES, SMALL_M_MAX, _use_triton, linear_config
from sparse_kernels.linear import _check as _check_linear
from sparse_kernels.rms_norm import rms_norm

# Benchmarks A/B the fused decode against the unfused one: ``SPARSE_KERNELS_FUSED_EPILOGUES=0`` in the
# environment, or this switch, turns ``fuses`` off (the model then runs its separate norm / SiLU launches).
ENABLED = os.environ.get("SPARSE_KERNELS_FUSED_EPILOGUES", "1").strip() != "0"


class NormedHidden(NamedTuple):
    """A hidden state with its next RMSNorm pending: ``norm(hidden) = scaled * rsqrt(sum(sumsq, 0) / dim + eps)``
    (``sumsq`` None: ``scaled`` is the norm's output already).

    ``hidden [M, N]`` (the residual stream), ``scaled = hidden * g`` (``g`` the norm's weight), ``sumsq
    [tiles, M]`` fp32 partial sums of ``hidden**2`` over disjoint column ranges, ``eps`` the norm's.
    """

    hidden: torch.Tensor
    scaled: torch.Tensor
    sumsq: torch.Tensor | None
    eps: float

    def normed(self) -> torch.Tensor:
        """The norm's output in ``hidden``'s dtype (one rounding of the fp32 product)."""
        if self.sumsq is None:
            return self.scaled
        return (self.scaled.float() * _row_scale(self)[:, None]).to(self.hidden.dtype)


def fuses(x: torch.Tensor, *, backend: str = "auto") -> bool:
    """Whether decode rows ``x [M, K]`` take the fused kernels: the Triton backend for ``x``'s device,
    ``bf16`` / ``fp16``, at most ``SMALL_M_MAX`` rows (the small-M kernel's range)."""
    check_backend(backend)
    rows = x.shape[0] if x.dim() == 2 else 0
    return ENABLED and 0 < rows <= SMALL_M_MAX and x.dtype in _AUTO_DTYPES and _use_triton(backend, x, rows)


def linear_add_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    *,
    backend: str = "auto",
) -> NormedHidden:
    """``h = x W^T + b + residual`` (one rounding) and what ``norm(h)`` needs, for the next projection.

    ``x [M, K]``, ``weight [N, K]``, ``residual [M, N]`` contiguous; ``h`` is written into ``residual``'s
    storage (the residual stream is updated in place) and returned as ``NormedHidden.hidden``.
    """
    _check(x, weight, bias)
    if residual.shape != (x.shape[0], weight.shape[0]) or residual.dtype != x.dtype or not residual.is_contiguous():
        raise ValueError(f"residual must be contiguous [M, N] = {[x.shape[0], weight.shape[0]]} in {x.dtype}")
    if norm_weight.shape != (weight.shape[0],):
        raise ValueError(f"norm_weight must be [N] = [{weight.shape[0]}], got {list(norm_weight.shape)}")
    if _kernel(backend, x):
        config = _config(x.shape[0], *weight.shape)
        tiles = -(-weight.shape[0] // config["BLOCK_N"])
        scaled = torch.empty_like(residual)
        sumsq = torch.empty(tiles, x.shape[0], dtype=torch.float32, device=x.device)
        from sparse_kernels._triton.linear import small_m_linear_triton

        small_m_linear_triton(
            _rows(x), weight, bias, config, residual=residual, norm_out=(norm_weight, scaled, sumsq), out=residual
        )
        return NormedHidden(residual, scaled, sumsq, eps)
    hidden = (F.linear(x.float(), weight.float(), _f32(bias)) + residual.float()).to(x.dtype)
    residual.copy_(hidden)
    h = residual.float()
    scaled = (h * norm_weight.float()).to(x.dtype)
    return NormedHidden(residual, scaled, (h * h).sum(-1)[None, :], eps)


def linear_normed(
    normed: NormedHidden,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    gated: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """``norm(h) W^T + b`` from ``normed`` (``linear_add_norm``'s result, or ``add_norm_inputs``').

    ``gated``: ``weight`` stacks gate over up (``[2 I, K]``); returns ``silu(gate) * up`` ``[M, I]``.
    """
    x = normed.scaled
    _check(x, weight, bias)
    sumsq = normed.sumsq
    if sumsq is not None and (sumsq.dim() != 2 or sumsq.shape[1] != x.shape[0] or sumsq.dtype != torch.float32):
        raise ValueError(f"sumsq must be fp32 [tiles, M = {x.shape[0]}], got {list(normed.sumsq.shape)}")
    if gated and weight.shape[0] % 2:
        raise ValueError(f"a gated weight stacks gate over up: an even row count, got {weight.shape[0]}")
    if _kernel(backend, x):
        from sparse_kernels._triton.linear import small_m_linear_triton

        config = _config(x.shape[0], *weight.shape)
        row_rms = None if sumsq is None else (sumsq, 1.0 / x.shape[1], float(normed.eps))
        return small_m_linear_triton(_rows(x), weight, bias, config, row_rms=row_rms, gated=gated)
    y = F.linear(x.float(), weight.float())
    if sumsq is not None:
        y = y * _row_scale(normed)[:, None]
    if bias is not None:
        y = y + bias.float()
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y.to(x.dtype)


def add_norm_inputs(hidden: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> NormedHidden:
    """``NormedHidden`` of a hidden state no projection wrote (the embedding, into the first layer): its norm
    by ``rms_norm`` (one launch), no sums pending."""
    return NormedHidden(hidden, rms_norm(hidden, norm_weight, eps), None, eps)


def _row_scale(normed: NormedHidden) -> torch.Tensor:
    return torch.rsqrt(normed.sumsq.sum(0) / normed.scaled.shape[1] + normed.eps)


def _config(rows: int, n: int, k: int) -> dict:
    """``linear_config``, except that a writer of sums of squares keeps its column tiles few (the reader
    loads one partial per tile): the 32-wide tiles, never the 4-wide broadcast tiles of a single row."""
    config = linear_config(rows, n, k)
    if config["BLOCK_N"] < 32:
        config = linear_config(2, n, k)
    return config


def _kernel(backend: str, x: torch.Tensor) -> bool:
    """``linear``'s rule: the kernel on the Triton backend, within the small-M range on ``auto``."""
    return _use_triton(check_backend(backend), x, x.shape[0])


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float()


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    _check_linear(x, weight, bias)
    if x.dim() != 2:
        raise ValueError(f"x [M, K] expected, got {list(x.shape)}")
    if weight.stride(1) != 1:
        raise ValueError("the weight needs unit stride along K")
