"""One layer's quantized paged KV: the tensors the quantized store, decode and prefill kernels read.

A pool block holds ``block_size`` tokens (slot ``= block_id * block_size + offset``, as for plain
pools). Every scheme keeps codes per token, so a slot can be read, gathered or compacted alone,
except KIVI's keys, whose statistics are per channel over a whole page (one page = one block):
KIVI therefore keeps each request's incomplete page in a full-precision tail and encodes it when
it fills. Schemes and layouts (``B`` = num_blocks, ``S`` = block_size, ``H`` = num_kv_heads,
``D`` = head_dim):

``fp8`` (e4m3, scales per token and KV head)
    ``k``, ``v``: float8_e4m3fn ``[B, S, H, D]``; ``k_scale``, ``v_scale``: float32 ``[B, S, H]``.
    Encode: ``s = max(amax(|x|) / 448, 1e-12)`` over ``D``; ``code = fp8(clamp(x / s, -448, 448))``
    (round to nearest even). A static per-layer scale, when given, is written as every token's ``s``.
    Decode: ``x = float(code) * s``.

``kivi`` (``bits`` in {2, 4}; ``group`` = KIVI's page size = ``block_size``, divides ``D``)
    ``k``, ``v``: int32 ``[B, S, H, D * bits / 32]`` (codes packed along ``D``: channel ``d`` is in
    word ``d // (32 / bits)`` at bit ``(d % (32 / bits)) * bits``).
    ``k_scale``, ``k_min``: float16 ``[B, H, D]``, per channel over the page's ``S`` tokens.
    ``v_scale``, ``v_min``: float16 ``[B, S, H, D / group]``, per token over groups of ``group``
    channels. ``k_tail``, ``v_tail``: the model dtype, ``[T, S, H, D]``: tail row ``t`` holds the
    first ``kv_len % S`` tokens of the incomplete last page of the request that owns row ``t``.
    Encode (asymmetric min/max): ``mn``, ``mx`` over the group in float32;
    ``scale = fp16(max((mx - mn) / (2**bits - 1), 2**-24))``, ``zero = fp16(mn)``;
    ``code = clamp(floor((x - zero) / scale + 0.5), 0, 2**bits - 1)`` with the stored (rounded)
    ``scale`` and ``zero``. Decode: ``x = code * scale + zero``.

``turboquant`` (``bits`` in {2, 3, 4}; ``seed``)
    Attention runs in a rotated space: ``R`` = ``turboquant_rotation(D, seed)`` (orthogonal,
    float32 ``[D, D]``); keys and values are stored as ``x @ R``, queries are rotated the same
    way and the output is rotated back with ``R.T``.
    ``k``, ``v``: int32 ``[B, S, H, ceil(D / (32 // bits))]`` (``32 // bits`` codes per word: 16,
    10 or 8; channel ``d`` in word ``d // (32 // bits)`` at bit ``(d % (32 // bits)) * bits``).
    ``k_scale``, ``v_scale``: float32 ``[B, S, H]``. ``codebook``: float32 ``[2**bits]``, the
    Lloyd-Max levels of a unit Gaussian. Encode: ``s = max(sqrt(mean(x**2)), 1e-30)`` over ``D``;
    ``code`` = the number of midpoints between adjacent levels that ``x / s`` exceeds.
    Decode: ``x = codebook[code] * s``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCHEMES = ("fp8", "kivi", "turboquant")
BITS = {"fp8": (8,), "kivi": (2, 4), "turboquant": (2, 3, 4)}
FP8_MAX = 448.0


def codes_per_word(scheme: str, bits: int) -> int:
    """How many codes one int32 word holds (fp8 keeps one byte per element: 1)."""
    return 1 if scheme == "fp8" else 32 // bits


def words_per_row(scheme: str, bits: int, head_dim: int) -> int:
    """Elements of the last dimension of ``k`` / ``v`` for one (token, head)."""
    return head_dim if scheme == "fp8" else -(-head_dim // codes_per_word(scheme, bits))


@dataclass(frozen=True, slots=True)
class QuantizedKV:
    """One layer's quantized KV tensors (see the module docstring for each scheme's layout).

    ``k_min`` / ``v_min`` exist for KIVI only; ``k_tail`` / ``v_tail`` for KIVI only; ``rotation``
    and ``codebook`` for TurboQuant only. Every tensor is contiguous and on one device.
    """

    scheme: str
    bits: int
    head_dim: int
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    k_min: torch.Tensor | None = None
    v_min: torch.Tensor | None = None
    k_tail: torch.Tensor | None = None
    v_tail: torch.Tensor | None = None
    rotation: torch.Tensor | None = None
    codebook: torch.Tensor | None = None
    group: int = 0

    @property
    def num_blocks(self) -> int:
        return self.k.shape[0]

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[2]

    @property
    def has_tail(self) -> bool:
        return self.k_tail is not None

    @property
    def device(self) -> torch.device:
        return self.k.device
