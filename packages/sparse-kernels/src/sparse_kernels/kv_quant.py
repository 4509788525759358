"""The quantization math of ``QuantizedKV``'s schemes as plain torch (the reference every kernel matches).

Layouts and formulas are those of ``sparse_kernels.quantized_kv``: fp8 (e4m3, a scale per token and KV
head), KIVI (Liu et al. 2024, https://arxiv.org/abs/2402.02750: keys per channel over a page, values
per token over channel groups, asymmetric min/max) and TurboQuant (Zandieh et al. 2025,
https://arxiv.org/abs/2504.19874: a seeded random rotation, then a Lloyd-Max codebook of a unit
Gaussian scaled per token and head; the MSE variant, without the QJL residual).
"""

from __future__ import annotations

import functools
import math
import statistics
from itertools import pairwise

import torch

from sparse_kernels.quantized_kv import BITS, FP8_MAX, SCHEMES, QuantizedKV, words_per_row

FP8_MIN_SCALE = 1e-12
KIVI_MIN_SCALE = 2.0**-24  # the smallest positive float16
TURBOQUANT_MIN_SCALE = 1e-30


def turboquant_rotation(head_dim: int, seed: int) -> torch.Tensor:
    """The orthogonal ``R`` (float32 ``[D, D]``) keys and values are rotated by: ``x @ R``.

    The Q factor of a float64 CPU Gaussian drawn from ``torch.Generator().manual_seed(seed)``, each
    column's sign set so that ``diag(r) > 0`` (the decomposition is then unique).
    """
    gen = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=gen, dtype=torch.float64))
    sign = torch.sign(torch.diagonal(r))
    return (q * torch.where(sign == 0, 1.0, sign)).to(torch.float32)


@functools.cache
def _lloyd_max_levels(bits: int) -> tuple[float, ...]:
    n = 2**bits
    levels = [statistics.NormalDist().inv_cdf((i + 0.5) / n) for i in range(n)]  # start at the quantiles

    def pdf(x: float) -> float:
        return 0.0 if math.isinf(x) else math.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)

    def cdf(x: float) -> float:
        return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))

    for _ in range(200):
        edges = [-math.inf, *((a + b) / 2 for a, b in pairwise(levels)), math.inf]
        # The mean of N(0, 1) between two edges: (pdf(a) - pdf(b)) / (cdf(b) - cdf(a)).
        new = [(pdf(a) - pdf(b)) / (cdf(b) - cdf(a)) for a, b in pairwise(edges)]
        change = max(abs(a - b) for a, b in zip(new, levels, strict=True))
        levels = new
        if change < 1e-9:
            break
    return tuple(levels)


def lloyd_max_codebook(bits: int) -> torch.Tensor:
    """Float32 ``[2**bits]``, ascending: Lloyd-Max levels of N(0, 1) (200 iterations or a change < 1e-9)."""
    return torch.tensor(_lloyd_max_levels(bits), dtype=torch.float32)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``[..., n]`` codes in ``[0, 2**bits)`` -> int32 ``[..., ceil(n / (32 // bits))]``.

    Code ``d`` goes to word ``d // (32 // bits)`` at bit ``(d % (32 // bits)) * bits``; unused high bits are 0.
    """
    per_word = 32 // bits
    n = codes.shape[-1]
    num_words = -(-n // per_word)
    codes = torch.nn.functional.pad(codes.to(torch.int64), (0, num_words * per_word - n))
    shifts = torch.arange(per_word, device=codes.device, dtype=torch.int64) * bits
    words = (codes.view(*codes.shape[:-1], num_words, per_word) << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # two's complement wrap


def unpack_codes(words: torch.Tensor, bits: int, num_codes: int) -> torch.Tensor:
    """Inverse of ``pack_codes``: int32 ``[..., W]`` -> int64 ``[..., num_codes]``."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, device=words.device, dtype=torch.int64) * bits
    codes = (words.to(torch.int64)[..., None] >> shifts) & (2**bits - 1)
    return codes.flatten(-2)[..., :num_codes]


def turboquant_midpoints(codebook: torch.Tensor) -> torch.Tensor:
    """The ``2**bits - 1`` decision edges between adjacent levels (float32)."""
    return (codebook[1:] + codebook[:-1]) / 2


def encode_rows(
    x: torch.Tensor,
    scheme: str,
    bits: int,
    *,
    codebook: torch.Tensor | None = None,
    static_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode per-token rows of ``fp8`` or ``turboquant``: ``x [..., D]`` -> ``(codes, scale [...])``.

    ``codes`` are in the stored form: float8_e4m3fn ``[..., D]`` (fp8) or packed int32 ``[..., W]``
    (turboquant, whose ``x`` must already be rotated: ``x @ R``). ``scale`` is float32.
    ``static_scale`` (fp8 only) is written as every row's scale.
    """
    x = x.float()
    if scheme == "fp8":
        if static_scale is None:
            scale = (x.abs().amax(-1) / FP8_MAX).clamp(min=FP8_MIN_SCALE)
        else:
            scale = torch.full(x.shape[:-1], static_scale, dtype=torch.float32, device=x.device)
        codes = (x / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # round to nearest even
        return codes, scale
    if scheme == "turboquant":
        if codebook is None:
            raise ValueError("turboquant needs its codebook")
        scale = torch.sqrt(torch.mean(x * x, dim=-1)).clamp(min=TURBOQUANT_MIN_SCALE)
        y = x / scale[..., None]
        codes = (y[..., None] > turboquant_midpoints(codebook.to(x.device))).sum(-1)  # midpoints exceeded
        return pack_codes(codes, bits), scale
    raise ValueError(f"encode_rows handles the per-token schemes fp8 and turboquant, not {scheme!r}")


def decode_rows(
    codes: torch.Tensor,
    scale: torch.Tensor,
    scheme: str,
    bits: int,
    head_dim: int,
    *,
    codebook: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inverse of ``encode_rows``: float32 ``[..., head_dim]`` (turboquant: still rotated)."""
    if scheme == "fp8":
        return codes.float() * scale[..., None].float()
    if scheme == "turboquant":
        if codebook is None:
            raise ValueError("turboquant needs its codebook")
        levels = codebook.to(codes.device)[unpack_codes(codes, bits, head_dim)]
        return levels * scale[..., None].float()
    raise ValueError(f"decode_rows handles the per-token schemes fp8 and turboquant, not {scheme!r}")


def kivi_quantize(x: torch.Tensor, mn: torch.Tensor, mx: torch.Tensor, bits: int):
    """Asymmetric min/max codes of float32 ``x`` against broadcastable ``mn`` / ``mx``.

    Returns ``(codes int64 like x, scale float16 like mn, zero float16 like mn)``.
    """
    scale = ((mx - mn) / (2**bits - 1)).clamp(min=KIVI_MIN_SCALE).to(torch.float16)
    zero = mn.to(torch.float16)
    codes = torch.floor((x - zero.float()) / scale.float() + 0.5).clamp(0, 2**bits - 1)
    return codes.to(torch.int64), scale, zero


def encode_kivi_pages(k: torch.Tensor, v: torch.Tensor, bits: int, group: int):
    """Encode whole KIVI pages: ``k``, ``v`` ``[P, S, H, D]`` (any float dtype).

    Returns ``(k_codes, v_codes, k_scale, k_min, v_scale, v_min)``: int32 codes ``[P, S, H, W]``,
    key stats float16 ``[P, H, D]`` (per channel over the page's ``S`` tokens), value stats float16
    ``[P, S, H, D / group]`` (per token over groups of ``group`` channels).
    """
    k, v = k.float(), v.float()
    k_codes, k_scale, k_min = kivi_quantize(k, k.amin(1, keepdim=True), k.amax(1, keepdim=True), bits)
    vg = v.unflatten(-1, (-1, group))  # [P, S, H, D / group, group]
    v_codes, v_scale, v_min = kivi_quantize(vg, vg.amin(-1, keepdim=True), vg.amax(-1, keepdim=True), bits)
    return (
        pack_codes(k_codes, bits),
        pack_codes(v_codes.flatten(-2), bits),
        k_scale.squeeze(1),
        k_min.squeeze(1),
        v_scale.squeeze(-1),
        v_min.squeeze(-1),
    )


def decode_kivi_pages(k_codes, v_codes, k_scale, k_min, v_scale, v_min, bits: int, head_dim: int):
    """Inverse of ``encode_kivi_pages``: float32 ``(k, v)`` ``[P, S, H, D]``."""
    k = unpack_codes(k_codes, bits, head_dim).float() * k_scale[:, None].float() + k_min[:, None].float()
    group = head_dim // v_scale.shape[-1]
    vc = unpack_codes(v_codes, bits, head_dim).float().unflatten(-1, (-1, group))
    v = vc * v_scale[..., None].float() + v_min[..., None].float()
    return k, v.flatten(-2)


def allocate_quantized_kv(
    scheme: str,
    bits: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    num_tails: int = 0,
    seed: int = 0,
) -> QuantizedKV:
    """A zero-filled ``QuantizedKV`` of one layer (``dtype`` = the model dtype of KIVI's tails).

    KIVI's ``group`` is ``block_size`` (which must divide ``head_dim``) and it gets ``num_tails`` tail
    rows; TurboQuant gets ``turboquant_rotation(head_dim, seed)`` and its codebook.
    """
    if scheme not in SCHEMES or bits not in BITS[scheme]:
        raise ValueError(f"unknown scheme/bits {scheme!r}/{bits}; known: {BITS}")
    rows = (num_blocks, block_size, num_kv_heads)
    width = words_per_row(scheme, bits, head_dim)

    def zeros(shape, dt):
        return torch.zeros(shape, dtype=dt, device=device)

    if scheme == "fp8":
        k, v = zeros((*rows, width), torch.float8_e4m3fn), zeros((*rows, width), torch.float8_e4m3fn)
        return QuantizedKV(scheme, bits, head_dim, k, v, zeros(rows, torch.float32), zeros(rows, torch.float32))
    k, v = zeros((*rows, width), torch.int32), zeros((*rows, width), torch.int32)
    if scheme == "turboquant":
        rotation, codebook = turboquant_rotation(head_dim, seed).to(device), lloyd_max_codebook(bits).to(device)
        k_scale, v_scale = zeros(rows, torch.float32), zeros(rows, torch.float32)
        return QuantizedKV(scheme, bits, head_dim, k, v, k_scale, v_scale, rotation=rotation, codebook=codebook)
    if head_dim % block_size:
        raise ValueError(f"KIVI's group (block_size {block_size}) must divide head_dim {head_dim}")
    k_stats, v_stats = (num_blocks, num_kv_heads, head_dim), (*rows, head_dim // block_size)
    tail = (num_tails, block_size, num_kv_heads, head_dim)
    return QuantizedKV(
        scheme,
        bits,
        head_dim,
        k,
        v,
        k_scale=zeros(k_stats, torch.float16),
        v_scale=zeros(v_stats, torch.float16),
        k_min=zeros(k_stats, torch.float16),
        v_min=zeros(v_stats, torch.float16),
        k_tail=zeros(tail, dtype),
        v_tail=zeros(tail, dtype),
        group=block_size,
    )


def dequantize_blocks(
    kv: QuantizedKV, block_ids: torch.Tensor, *, dtype: torch.dtype = torch.float32, unrotate: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized ``(k, v)`` of the listed blocks: ``dtype`` ``[n, S, H, D]``, from the codes only.

    KIVI's tails are not included (a block whose page is incomplete decodes to its stale codes).
    TurboQuant's rows are rotated back (``@ R.T``) when ``unrotate``, else left in the rotated space.
    """
    ids = block_ids.to(device=kv.device, dtype=torch.int64)
    if kv.scheme == "kivi":
        k, v = decode_kivi_pages(
            kv.k[ids], kv.v[ids], kv.k_scale[ids], kv.k_min[ids], kv.v_scale[ids], kv.v_min[ids], kv.bits, kv.head_dim
        )
    else:
        k, v = (
            decode_rows(codes[ids], scale[ids], kv.scheme, kv.bits, kv.head_dim, codebook=kv.codebook)
            for codes, scale in ((kv.k, kv.k_scale), (kv.v, kv.v_scale))
        )
        if kv.scheme == "turboquant" and unrotate:
            k, v = k @ kv.rotation.T, v @ kv.rotation.T
    return k.to(dtype), v.to(dtype)
