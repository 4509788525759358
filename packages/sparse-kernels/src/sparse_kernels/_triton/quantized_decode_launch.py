"""Host side of the quantized split-K decode: constexprs per scheme, then the split kernel and the shared reduce."""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

from sparse_kernels._decode_buffers import DecodeBuffers
from sparse_kernels._decode_layout import DecodeLayout
from sparse_kernels._triton.decode_launch import launch_reduce, logits_strides
from sparse_kernels._triton.launch import pdl_args
from sparse_kernels._triton.quantized_decode import quantized_decode_split_kernel
from sparse_kernels._triton.quantized_tiles import SCHEME_IDS
from sparse_kernels.quantized_kv import QuantizedKV, codes_per_word, words_per_row

LOG2_E = 1.4426950408889634
# Tokens per step and launch shape: the per-token schemes (fp8, TurboQuant), and KIVI, which steps one page.
# Both run one-warp programs (and four times the programs, _decode_buffers.QUANTIZED_WARPS_PER_SM). The best
# of sweeps on an H200 at 128K (benchmarks/NOTES.md, session 16): 32 tokens a step, 1 warp, 3 stages took fp8
# from 52-61% to 74-82% of copy bandwidth at batch 5-16 and TurboQuant-4 / -3 / -2 from 14.9 / 4.6 / 9.0% to
# 18.5 / 6.2 / 10.5% at batch 16 (128 tokens, 4 warps before); KIVI in one warp 2.0x faster than in 4 at batch
# 16, 1.7x at batch 4. UNPACK_WORDS (packed codes): load each packed word once and shift it into its channels,
# instead of a load per channel (4-10x slower; 3-bit rows, 10 codes a word, always take it).
# SWAP_AB: the dots transposed (a step's tokens as the MMA's rows, the query group of 4 as its columns, unpadded).
# sm_90 SASS on the CPU (benchmarks/sass_counts.py --swap-ab, session 26), instructions a 32-token step in one warp:
# KIVI-4 2105 -> 1298 (48 bytes of spills -> none; its keys a dot per bit position, its values in shift-major rows,
# so neither tile crosses shared memory), KIVI-2 2135 -> 1553 (128 -> none), fp8 1015 -> 827, TurboQuant-3 2767 ->
# 2736; half the HMMAs. Timed on an H200 (session 27, quantized_decode_bandwidth.py, batch 16 at 128K, one layer):
# KIVI-4 2858 -> 2190 us (3 stages: 2154), KIVI-2 2696 -> 2340, fp8 1387 -> 1369, TurboQuant-4 / -3 / -2 2889 /
# 7099 / 2686 -> 2743 / 6970 / 2584; in the engine at 128K x 5 (swap_c1 against session 25's stores_c1) KIVI-4's
# kernel 38.8 -> 31.8 ms a step, but fp8's 14.6 -> 16.8 ms (and 34.0 -> 34.7 at its largest batch, 11). So KIVI
# transposes by default and the per-token schemes (fp8, TurboQuant) do not; ``SPARSE_KERNELS_SWAP_AB`` = 1 / 0 turns
# both on / off for a whole process (so that the engine benchmark can A/B it; reports record it).
# Session 30: with a step's page ids as scalars (``step_rows``) fp8's sm_90 SASS per 32-token step went 1231 -> 1053
# instructions as written, 1044 -> 832 transposed; on an H200 (fp8_c3, block 16, one layer at 128K) 407.7 -> 399.1 us
# at batch 5 and 934.6 -> 842.9 at 11 as written, 801.7 transposed; in the engine fp8's kernel at its largest batch (11)
# 29.28 ms a step as written against 28.35 transposed (at 5: 14.03 against 14.48), so the per-token schemes transpose
# by default too (its largest batch is what issue 14 measures).
_SWAP_ENV = os.environ.get("SPARSE_KERNELS_SWAP_AB", "").strip()
_SWAP_AB = {"1": (True, True), "0": (False, False)}.get(_SWAP_ENV, (True, True))  # (per-token, KIVI)
# Session 30: fp8 at 16 tokens a step (a page, one scalar page id) took 743.3 us against 768.3 in one probe sweep
# (fp8_pairs_c5, 11 x 128K, block 16), 766.9 against 767.1 in the next, and in the engine 19.66 / 33.28 ms a step at 5 /
# 11 against 17.61 / 32.34 (fp8_block16_c6): 32 kept.
# warps_per_sm: resident warps a scheme's split count aims at (default _decode_buffers.QUANTIZED_WARPS_PER_SM, 32).
# Session 30 (snapkv_fp8_c7/per_sm_c8, per_sm_c9; engine, fp8 at its largest batch 11 x 128K, 88 lists, 64 / 128 timed
# steps): 32 (48 splits) 30.74 / 30.61 / 30.56 ms a step, 24 (36 splits) 29.87 / 29.74 / 29.75, 28 (42) 33.02, 16
# (24) 35.87; at batch 5 both give the 64-split cap.
QUANT_DECODE_CONFIG = {
    "BLOCK_N": 32,
    "num_warps": 1,
    "num_stages": 3,
    "UNPACK_WORDS": True,
    "SWAP_AB": _SWAP_AB[0],
    "warps_per_sm": {"fp8": 24},
}
# PAIRS (KIVI with SWAP_AB on the GPU): codes unpacked two per word half-pair in inline PTX (``half_pairs``). sm_90
# SASS per 32-token step KIVI-4 1298 -> 1048, KIVI-2 1553 -> 1028; on an H200 (session 27, pairs_c6, batch 16 x 128K,
# one layer) KIVI-4 2156 -> 2007 us, KIVI-2 2392 -> 1782, and KIVI-4 at its largest engine batch (18) 100.1 -> 96.2
# ms a step. On by default; ``SPARSE_KERNELS_KIVI_PAIRS=0`` turns it off.
_PAIRS = os.environ.get("SPARSE_KERNELS_KIVI_PAIRS", "1").strip() != "0"
# GROUPED (KIVI with SWAP_AB, a value group of CPW / 2 * words >= 16 rows): the values' codes enter one dot per channel
# group, exact integers, each group against its own probabilities p * scale (the minima's term from one more small
# dot), a token pair's codes of one channel in one register (the MMA's reduction pair: no tile through shared memory);
# the keys' minima term from one dot a page, and every code by one LOP3 and an exact HFMA2 (``half_pairs``). sm_90
# SASS under Triton 3.6 (the GPU box's) per 32-token step: KIVI-4 1366 -> 882, KIVI-2 1338 -> 857 (STS 144 -> 24).
# H200, batch 16 x 128K, one layer (session 30, kivi_c1): KIVI-4 1997 -> 1299 us (31.7 -> 48.6% of copy BW), KIVI-2
# 1776 -> 1420; batch 5: 749 -> 502, 645 -> 548. A cap of 168 registers (``maxnreg``, Triton's launch option; the
# one-warp program otherwise takes 255, 8 resident a SM): KIVI-2 1420 -> 1298 us, KIVI-4 1299 -> 1289 (128: slower,
# spills). ``SPARSE_KERNELS_KIVI_GROUPED=0`` / ``SPARSE_KERNELS_KIVI_MAXNREG=0`` turn them off.
_GROUPED = os.environ.get("SPARSE_KERNELS_KIVI_GROUPED", "1").strip() != "0"
_MAXNREG = int(os.environ.get("SPARSE_KERNELS_KIVI_MAXNREG", "168").strip() or 0)
KIVI_DECODE_CONFIG = {
    "num_warps": 1,
    "num_stages": 3 if _SWAP_AB[1] else 2,
    "SWAP_AB": _SWAP_AB[1],
    "PAIRS": _PAIRS,
    "GROUPED": _GROUPED,
    "maxnreg": _MAXNREG,
}


def decode_config(kv: QuantizedKV) -> dict[str, Any]:
    """The launch config of ``kv``'s scheme (the dicts above; benchmarks patch them in place)."""
    return KIVI_DECODE_CONFIG if kv.scheme == "kivi" else QUANT_DECODE_CONFIG


def block_n(kv: QuantizedKV) -> int:
    """Tokens per inner step (and the granularity of splits): a page for KIVI."""
    return kv.block_size if kv.scheme == "kivi" else decode_config(kv)["BLOCK_N"]


def quant_dot_args(device: torch.device) -> dict[str, Any]:
    """fp16 tensor-core dots on the GPU (e4m3 codes, small integer codes and codebook levels are exact or
    near-exact in fp16); IEEE fp32 under the interpreter, which cannot multiply 16-bit floats in ``tl.dot``."""
    if device.type == "cpu":
        return {"DOT_DTYPE": tl.float32, "PRECISION": "ieee"}
    return {"DOT_DTYPE": tl.float16, "PRECISION": "tf32"}


def codebook_launch(codebook: torch.Tensor | None, head_dim: int) -> tuple[torch.Tensor | None, dict[str, Any]]:
    """A kernel's TurboQuant arguments: the levels in the dot dtype (``dot_codebook``) and the packed-code
    constexprs of its tile loader (``token_key_tile`` / ``token_value_tile``); placeholders without one."""
    if codebook is None:
        return None, {"CODEBOOK": False, "BITS": 0, "CPW": 1, "WORDS": 1, "UNPACK_WORDS": False}
    bits = codebook.numel().bit_length() - 1
    cpw = codes_per_word("turboquant", bits)
    words = words_per_row("turboquant", bits, head_dim)
    block_d = max(16, triton.next_power_of_2(head_dim))
    unpack = QUANT_DECODE_CONFIG["UNPACK_WORDS"] and words * cpw == block_d and cpw & (cpw - 1) == 0
    args = {"CODEBOOK": True, "BITS": bits, "CPW": cpw, "WORDS": words, "UNPACK_WORDS": bool(unpack)}
    return dot_codebook(codebook), args


def scheme_args(kv: QuantizedKV) -> dict[str, Any]:
    """The scheme's constexprs: code layout, and whether whole words can be unpacked by a reshape."""
    cpw = codes_per_word(kv.scheme, kv.bits)
    words = words_per_row(kv.scheme, kv.bits, kv.head_dim)
    block_d = max(16, triton.next_power_of_2(kv.head_dim))
    unpack = QUANT_DECODE_CONFIG["UNPACK_WORDS"] and kv.scheme != "fp8" and words * cpw == block_d
    unpack = unpack and cpw & (cpw - 1) == 0
    return {
        "SCHEME": SCHEME_IDS[kv.scheme],
        "BITS": kv.bits,
        "CPW": cpw,
        "WORDS": words,
        "NUM_GROUPS": kv.head_dim // kv.group if kv.scheme == "kivi" else 1,
        "BLOCK_D": block_d,
        "UNPACK_WORDS": bool(unpack),
    }


_codebooks: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}


def kv_pointers(kv: QuantizedKV) -> list[torch.Tensor]:
    """The ten tensor arguments of the quantized kernels, with ``k_scale`` standing in for absent ones.

    TurboQuant's codebook goes in the dot dtype (fp16 on the GPU), so a lookup needs no conversion. Its
    levels depend on the bit width alone (the Lloyd-Max levels of a unit Gaussian), so the converted copy
    is made once per (bits, device) and reused, also inside CUDA graphs captured after a first run.
    """
    fill = kv.k_scale
    codebook = None if kv.codebook is None else dot_codebook(kv.codebook)
    optional = (kv.k_min, kv.v_min, kv.k_tail, kv.v_tail, codebook)
    return [kv.k, kv.v, kv.k_scale, kv.v_scale, *(fill if t is None else t for t in optional)]


def dot_codebook(codebook: torch.Tensor) -> torch.Tensor:
    """TurboQuant's levels in the dot dtype (fp16 on the GPU, float32 under the interpreter), converted once per
    (bits, device) and reused, also inside CUDA graphs captured after a first run (the levels depend on the bit
    width alone)."""
    dtype = torch.float32 if codebook.device.type == "cpu" else torch.float16
    key = (codebook.numel(), codebook.device, dtype)
    if key not in _codebooks:
        _codebooks[key] = codebook.to(dtype)
    return _codebooks[key]


def run_quantized_decode_triton(
    layout: DecodeLayout,
    bufs: DecodeBuffers,
    q: torch.Tensor,
    kv: QuantizedKV,
    out: torch.Tensor,
    logits_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inputs checked by the wrapper (``q`` already rotated for TurboQuant); writes ``out`` (and ``logits_out``,
    float32 ``[B, Hq, W]``, a per-token scheme's raw logits)."""
    if q.stride(2) != 1:
        q = q.contiguous()
    kivi = kv.scheme == "kivi"
    config = decode_config(kv)
    launch = {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
    if config.get("maxnreg") and q.device.type == "cuda":  # a register cap (more resident programs, maybe spills)
        launch["maxnreg"] = config["maxnreg"]
    per_sm = config.get("warps_per_sm", {}).get(kv.scheme)
    num_splits = bufs.num_splits(layout.batch, layout.num_kv_heads, True, config["num_warps"], per_sm)
    scheme = scheme_args(kv)
    shape = {
        "NUM_KV_HEADS": layout.num_kv_heads,
        "GROUP": layout.group,
        "HEAD_DIM": layout.head_dim,
        "PAGE_SIZE": layout.page_size,
        "HEAD_SPARSE": layout.head_sparse,
        "BLOCK_D": scheme.pop("BLOCK_D"),
        "BLOCK_N": block_n(kv),
    }
    swap = bool(config.get("SWAP_AB", False))
    grid = (layout.batch, layout.num_kv_heads, num_splits)
    quantized_decode_split_kernel[grid](
        q,
        *kv_pointers(kv),
        bufs.indptr,
        bufs.indices,
        bufs.last_len,
        bufs.tail_index if kivi else bufs.indptr,
        bufs.o_part,
        bufs.lse_part,
        logits_out if logits_out is not None else bufs.lse_part,
        q.stride(0),
        q.stride(1),
        *logits_strides(logits_out),
        layout.sm_scale * LOG2_E,
        num_splits,
        LOGITS=logits_out is not None,
        # As the dot's rows the group is padded to 16 (the MMA's rows); as its columns (SWAP_AB) Triton pads it.
        BLOCK_G=triton.next_power_of_2(layout.group) if swap else max(16, triton.next_power_of_2(layout.group)),
        SWAP_AB=swap,
        PAIRS=bool(config.get("PAIRS", False)),
        GROUPED=bool(config.get("GROUPED", False)),
        **scheme,
        **shape,
        **quant_dot_args(q.device),
        **launch,
        **pdl_args(q.device),
    )
    launch_reduce(layout, bufs, num_splits, out, 0, {**shape, "WINDOW": False})  # run_quantized: no window yet
    return out
