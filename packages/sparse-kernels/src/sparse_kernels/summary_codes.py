"""Block summaries as int8 codes with one scale per (block, KV head): half the bytes page bounds read.

A block's summary of one KV head is the elementwise min and max of its keys (``block_summary``). As codes,
the head's ``scale = amax / 127`` (``amax``: the largest magnitude among its min / max values) and the codes
round *outward*: ``kmin = floor(min / scale)``, ``kmax = ceil(max / scale)``, so ``scale * kmin <= min``
and ``scale * kmax >= max`` elementwise (up to float32 rounding of the scale itself) and Quest's page bound
``scale * sum_d max(q_d * kmax_d, q_d * kmin_d)`` still bounds every ``q . k`` of the page from above. A
bound is at most ``scale * sum_d |q_d|`` looser than the model-dtype summary's.

Codes are always a fresh encoding of the block's keys: a decode step re-summarizes its row's block from
the block's stored keys (at most ``block_size`` rows, ``update_block_summaries``) instead of folding the new
key into rounded codes, which would loosen them step after step. Divisions are IEEE round-to-nearest in
both this reference and the Triton kernels (``div_rn``), so their codes agree exactly.

This is the plain-torch reference the kernels (``block_summary``, ``update_block_summaries`` and
``page_bounds`` with ``scale=``) are held equal to.
"""

from __future__ import annotations

import torch

CODE_MAX = 127


def encode_summary(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes of elementwise ``lo <= hi`` summaries ``[..., Hkv, D]``: int8 ``kmin``, ``kmax`` ``[..., Hkv, D]``
    and float32 ``scale`` ``[..., Hkv]`` (1 where a head's summary is all zero)."""
    lo, hi = lo.float(), hi.float()
    scale = code_scale(torch.maximum(lo.abs(), hi.abs()).amax(-1))
    return _codes(torch.floor(lo / scale[..., None])), _codes(torch.ceil(hi / scale[..., None])), scale


def code_scale(amax: torch.Tensor) -> torch.Tensor:
    """The float32 scale of int8 codes whose largest magnitude stands for ``amax``: ``amax / 127`` (IEEE division),
    1 where ``amax`` is 0."""
    # A tensor divisor: CUDA torch multiplies by the reciprocal of a scalar one (not IEEE division).
    return torch.where(amax > 0, amax / torch.full_like(amax, CODE_MAX), torch.ones_like(amax))


def decode_summary(kmin: torch.Tensor, kmax: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 bounds ``scale * kmin``, ``scale * kmax`` the codes stand for."""
    return kmin.float() * scale[..., None], kmax.float() * scale[..., None]


def _codes(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-CODE_MAX, CODE_MAX).to(torch.int8)
