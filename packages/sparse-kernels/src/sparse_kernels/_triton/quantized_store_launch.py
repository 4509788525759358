"""Launchers of the quantized store kernels (inputs already validated by ``store_kv_quantized``)."""

from __future__ import annotations

import torch
import triton

from sparse_kernels._triton.launch import pdl_args
from sparse_kernels._triton.quantized_store import store_fp8_kernel, store_kivi_decode_kernel, store_turboquant_kernel
from sparse_kernels.quantized_kv import QuantizedKV, words_per_row


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(2) == 1 else t.contiguous()


def store_rows_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    kv: QuantizedKV,
    slot_mapping: torch.Tensor,
    static_scales: tuple[float, float] | None,
) -> None:
    """fp8 (rows in the model dtype, any row/head strides) or TurboQuant (rows already rotated, float32)."""
    num_rows, num_kv_heads, head_dim = key.shape
    grid = (num_rows, num_kv_heads)
    if kv.scheme == "fp8":
        key, value = _unit_last(key), _unit_last(value)
        k_static, v_static = static_scales if static_scales is not None else (0.0, 0.0)
        store_fp8_kernel[grid](
            key, value, kv.k.view(torch.uint8), kv.v.view(torch.uint8), kv.k_scale, kv.v_scale, slot_mapping,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1), float(k_static), float(v_static),
            NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
            STATIC=static_scales is not None, num_warps=1, **pdl_args(key.device),
        )  # fmt: skip
        return
    per_word = 32 // kv.bits
    store_turboquant_kernel[grid](
        key.contiguous(), value.contiguous(), kv.k, kv.v, kv.k_scale, kv.v_scale, slot_mapping, kv.codebook,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BITS=kv.bits, CPW=per_word,
        NUM_WORDS=words_per_row(kv.scheme, kv.bits, head_dim),
        BLOCK_W=triton.next_power_of_2(words_per_row(kv.scheme, kv.bits, head_dim)),
        BLOCK_C=triton.next_power_of_2(per_word), num_warps=1, **pdl_args(key.device),
    )  # fmt: skip


def store_kivi_decode_triton(
    key: torch.Tensor, value: torch.Tensor, kv: QuantizedKV, slot_mapping: torch.Tensor, tail_index: torch.Tensor
) -> None:
    """KIVI, one row per request: rows already in the tail dtype."""
    num_rows, num_kv_heads, head_dim = key.shape
    key, value = _unit_last(key), _unit_last(value)
    page = kv.block_size
    store_kivi_decode_kernel[(num_rows, num_kv_heads)](
        key, value, kv.k, kv.v, kv.k_scale, kv.k_min, kv.v_scale, kv.v_min, kv.k_tail, kv.v_tail,
        slot_mapping, tail_index, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE=page, BITS=kv.bits,
        BLOCK_D=triton.next_power_of_2(head_dim), num_warps=4 if page * head_dim <= 4096 else 8,
        **pdl_args(key.device),
    )  # fmt: skip
