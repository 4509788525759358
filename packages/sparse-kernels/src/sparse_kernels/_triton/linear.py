"""Triton small-M linear (decode GEMV): ``out = x W^T (+ b)`` for a few rows of ``x``.

At decode a projection multiplies 1-16 token rows by a weight of tens of megabytes, so the step is a
pure weight read. Program ``n`` owns ``BLOCK_N`` output columns (weight rows, contiguous along K),
streams them once in ``BLOCK_K`` tiles and keeps every row of ``x`` in registers. The grid is
``cdiv(N, BLOCK_N)`` programs, times ``SPLIT_K`` for narrow outputs (too few column tiles to keep every
SM streaming): split ``s`` covers a ``K / SPLIT_K`` slice, writes its fp32 partial to a scratch tile and
counts itself in an int32 arrival counter per column tile; the split that arrives last sums the partials,
writes the output and resets the counter to 0 (ready for the next launch and CUDA-graph replays). One
launch either way (cuBLAS's small-M kernels add a separate split-K reduce per call).

``USE_DOT`` picks ``tl.dot`` on a ``BLOCK_M >= 16`` tile (rows past M masked; tensor cores are idle
anyway), else a broadcast multiply and a sum over K in fp32 (``BLOCK_M`` up to a few rows).

Epilogues (``sparse_kernels.linear_epilogue`` holds their contract and reference): ``ROW_RMS`` scales
row ``m`` of the product by ``rsqrt(sum of the writer's partial sums of squares / dim + eps)`` (loaded
before the K loop, summed after it); ``GATED`` streams gate row ``c`` and up row ``gate_offset + c`` in
one tile (its first and second halves) and writes ``silu(gate) * up``; ``RESIDUAL`` adds ``res`` and
writes the sum (the new hidden state), and with ``NORM_OUT`` also the sum times ``g`` and the tile's
sum of squares per row (fp32, at ``[column tile, row]``) for the next projection's ``ROW_RMS``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_kernels._triton import scratch
from sparse_kernels._triton.launch import Kernel, pdl_args, pdl_enter, pdl_exit


def _small_m_linear_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    part_ptr,
    arrivals_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_om,
    res_ptr,  # RESIDUAL: [M, N] added to the product (may be out_ptr: each program reads then writes its tile)
    g_ptr,  # NORM_OUT: [N] the next norm's weight
    xg_ptr,  # NORM_OUT: [M, N] (out * g), rows strided like out
    ssq_out_ptr,  # NORM_OUT: [column tiles, M] fp32 sums of squares of out's rounded values
    ssq_in_ptr,  # ROW_RMS: [ssq_tiles, M] fp32, the writer's partial sums of squares
    ssq_tiles,
    inv_dim,
    eps,
    gate_offset,  # GATED: the up rows start here; the output has gate_offset columns
    HAS_BIAS: tl.constexpr,
    USE_DOT: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_GDC: tl.constexpr,
    RESIDUAL: tl.constexpr = False,
    NORM_OUT: tl.constexpr = False,
    ROW_RMS: tl.constexpr = False,
    GATED: tl.constexpr = False,
    SSQ_BLOCK: tl.constexpr = 1,
):
    pdl_enter(USE_GDC)
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    if GATED:  # gate rows [pid * HALF, + HALF) then the matching up rows
        HALF: tl.constexpr = BLOCK_N // 2
        j = tl.arange(0, BLOCK_N)
        col = pid * HALF + j % HALF
        offs_n = col + (j // HALF) * gate_offset
        mask_n = col < gate_offset
    else:
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
    if RESIDUAL:  # issued before the weight stream: the epilogue's stores then wait on no load
        res = tl.load(res_ptr + offs_m[:, None] * stride_om + offs_n[None, :], mask=mask_m[:, None] & mask_n[None, :])
        if NORM_OUT:
            g = tl.load(g_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    if ROW_RMS:  # issued before the weight stream, summed after it
        t = tl.arange(0, SSQ_BLOCK)
        ssq = tl.load(
            ssq_in_ptr + t[:, None] * M + offs_m[None, :], mask=(t[:, None] < ssq_tiles) & mask_m[None, :], other=0.0
        )
    w_rows = w_ptr + offs_n.to(tl.int64) * stride_wn  # [BLOCK_N]: int64, large vocab heads
    x_rows = x_ptr + offs_m * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_lo = tl.program_id(1) * k_per_split  # k_per_split: K (one split) or a multiple of BLOCK_K
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < k_hi
        x = tl.load(x_rows[:, None] + k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if USE_DOT:
            w = tl.load(w_rows[None, :] + k[:, None], mask=mask_n[None, :] & mask_k[:, None], other=0.0)
            acc += tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision=PRECISION)  # [BLOCK_K, BLOCK_N]
        else:
            w = tl.load(w_rows[:, None] + k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            prod = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]  # [BLOCK_M, BLOCK_N, BLOCK_K]
            acc += tl.sum(prod, 2)
    last = True
    if SPLIT_K > 1:
        # Partials of column tile ``pid``: [SPLIT_K, BLOCK_M, BLOCK_N] fp32, contiguous per tile.
        tile = part_ptr + pid * (SPLIT_K * BLOCK_M * BLOCK_N) + offs_m[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(tile + tl.program_id(1) * (BLOCK_M * BLOCK_N), acc)
        tl.debug_barrier()  # every thread's partial precedes the release below
        last = tl.atomic_add(arrivals_ptr + pid, 1, sem="acq_rel") == SPLIT_K - 1
        if last:
            tl.store(arrivals_ptr + pid, 0)  # no split of this launch counts here again
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for split in range(SPLIT_K):  # in split order: the sum does not depend on who came last
                acc += tl.load(tile + split * (BLOCK_M * BLOCK_N), cache_modifier=".cg")
    if last:
        if ROW_RMS:
            acc = acc * (1.0 / tl.sqrt(tl.sum(ssq, 0) * inv_dim + eps))[:, None]
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if GATED:
            gate, up = tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, HALF]), (0, 2, 1)))
            cols = pid * HALF + tl.arange(0, HALF)
            out = out_ptr + offs_m[:, None] * stride_om + cols[None, :]
            silu = gate / (1.0 + tl.exp(-gate))
            mask = mask_m[:, None] & (cols < gate_offset)[None, :]
            tl.store(out, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)
        else:
            mask = mask_m[:, None] & mask_n[None, :]
            if RESIDUAL:
                acc += res.to(tl.float32)
            y = acc.to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y, mask=mask)
            if NORM_OUT:  # what the next projection's ROW_RMS reads: out * g and the tile's sums of squares
                yf = y.to(tl.float32)
                tl.store(ssq_out_ptr + pid * M + offs_m, tl.sum(yf * yf, 1), mask=mask_m)
                xg = (yf * g[None, :]).to(xg_ptr.dtype.element_ty)
                tl.store(xg_ptr + offs_m[:, None] * stride_om + offs_n[None, :], xg, mask=mask)
    pdl_exit(USE_GDC)


small_m_linear_kernel = Kernel(_small_m_linear_kernel)

_SCRATCH: dict[torch.device, tuple[torch.Tensor, ...]] = {}


def split_scratch(device: torch.device, partial_elements: int, tiles: int) -> tuple[torch.Tensor, ...]:
    """The split-K partials (fp32) and arrival counters (int32, all 0 between launches) of ``device``
    (``scratch.grown``: shared by every call, each leaving its counters at 0)."""
    return scratch.grown(_SCRATCH, device, ((partial_elements, torch.float32, False), (tiles, torch.int32, True)))


def small_m_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: dict,
    *,
    residual: torch.Tensor | None = None,
    norm_out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    row_rms: tuple[torch.Tensor, float, float] | None = None,
    gated: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inputs checked by ``sparse_kernels.linear`` (or ``linear_epilogue``); ``x`` is 2-D with unit stride on K.

    ``config``: ``USE_DOT``, ``BLOCK_N``, ``BLOCK_K``, ``num_warps``, ``num_stages`` (``BLOCK_M`` is
    derived from M: the next power of two, at least 16 for ``tl.dot``). Epilogues (contiguous ``[M, N]``
    tensors): ``residual`` added (``out`` may be it); ``norm_out = (g, xg, ssq)``: also ``xg = out * g`` and
    the per-column-tile sums of squares ``ssq [cdiv(N, BLOCK_N), M]``; ``row_rms = (ssq, 1 / dim, eps)``;
    ``gated``: the output is ``silu(gate) * up`` of width ``N / 2``.
    """
    from sparse_kernels._triton.launch import dot_args

    m, k = x.shape
    n = weight.shape[0]
    width = n // 2 if gated else n
    if out is None:
        out = torch.empty(m, width, dtype=x.dtype, device=x.device)
    use_dot = bool(config["USE_DOT"])
    block_m = max(16 if use_dot else 1, triton.next_power_of_2(m))
    tiles = triton.cdiv(width, config["BLOCK_N"] // 2) if gated else triton.cdiv(n, config["BLOCK_N"])
    split_k = min(config.get("SPLIT_K", 1), triton.cdiv(k, config["BLOCK_K"]))
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), config["BLOCK_K"]) * config["BLOCK_K"]
    split_k = triton.cdiv(k, k_per_split)  # every split non-empty
    part, arrivals = (
        (out, out) if split_k == 1 else split_scratch(x.device, tiles * split_k * block_m * config["BLOCK_N"], tiles)
    )
    g, xg, ssq_out = norm_out if norm_out is not None else (out, out, out)
    ssq_in, inv_dim, eps = row_rms if row_rms is not None else (out, 0.0, 0.0)
    ssq_tiles = ssq_in.shape[0] if row_rms is not None else 1
    small_m_linear_kernel[(tiles, split_k)](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        part,
        arrivals,
        m,
        n,
        k,
        k_per_split,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        residual if residual is not None else out,
        g,
        xg,
        ssq_out,
        ssq_in,
        ssq_tiles,
        inv_dim,
        eps,
        width,
        HAS_BIAS=bias is not None,
        USE_DOT=use_dot,
        SPLIT_K=split_k,
        BLOCK_M=block_m,
        BLOCK_N=config["BLOCK_N"],
        BLOCK_K=config["BLOCK_K"],
        **dot_args(weight.dtype, weight.device),
        RESIDUAL=residual is not None,
        NORM_OUT=norm_out is not None,
        ROW_RMS=row_rms is not None,
        GATED=gated,
        SSQ_BLOCK=triton.next_power_of_2(ssq_tiles),
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
        **pdl_args(x.device),
    )
    return out
