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

The small kernels between a decoder's projections ride in them (``sparse_kernels.linear``'s fused entry
points), each rounding where its standalone kernel rounds:
- ``GATED``: ``x`` is ``[gate | up]`` (``2K`` wide) and each K tile of the input is ``silu(gate) * up``.
- ``NORM``: each K tile of the input is ``rms_norm(x)``'s, from the row's sum of squares, which the kernel
  that wrote ``x`` left as partial sums per column tile (``sq_in``, ``[M, tiles_in]`` fp32).
- ``RESIDUAL``: the output is ``x W^T + residual`` (rounded as a separate add) and each column tile also
  writes its rows' partial sum of squares of that output (``sq_out``, ``[M, tiles]``) for a ``NORM`` consumer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_kernels._triton.launch import Kernel, pdl_args, pdl_enter, pdl_exit


def _small_m_linear_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    part_ptr,
    arrivals_ptr,
    res_ptr,
    sq_out_ptr,
    norm_w_ptr,
    sq_in_ptr,
    tiles_in,
    eps,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_om,
    stride_rm,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    NORM: tl.constexpr,
    RESIDUAL: tl.constexpr,
    BLOCK_T: tl.constexpr,
    USE_DOT: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    pdl_enter(USE_GDC)
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64) * stride_wn  # [BLOCK_N]: int64, large vocab heads
    x_rows = x_ptr + offs_m * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_lo = tl.program_id(1) * k_per_split  # k_per_split: K (one split) or a multiple of BLOCK_K
    k_hi = tl.minimum(k_lo + k_per_split, K)
    if NORM:  # the row's 1 / rms from the writer's partial sums of squares
        offs_t = tl.arange(0, BLOCK_T)
        sq = tl.load(
            sq_in_ptr + offs_m[:, None] * tiles_in + offs_t[None, :],
            mask=mask_m[:, None] & (offs_t < tiles_in)[None, :],
            other=0.0,
        )
        inv_rms = tl.math.rsqrt(tl.sum(sq, 1) / K + eps)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < k_hi
        mask_x = mask_m[:, None] & mask_k[None, :]
        x = tl.load(x_rows[:, None] + k[None, :], mask=mask_x, other=0.0)
        if GATED:  # silu(gate) * up, rounded as silu_and_mul rounds
            up = tl.load(x_rows[:, None] + K + k[None, :], mask=mask_x, other=0.0)
            gate = x.to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(x.dtype).to(tl.float32)
            x = (act * up.to(tl.float32)).to(x.dtype)
        if NORM:  # rms_norm's roundings: the normalised row, then the weight
            nw = tl.load(norm_w_ptr + k, mask=mask_k, other=0.0).to(tl.float32)
            y = (x.to(tl.float32) * inv_rms[:, None]).to(x.dtype).to(tl.float32)
            x = (nw[None, :] * y).to(x.dtype)
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
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        mask_o = mask_m[:, None] & mask_n[None, :]
        y = acc.to(out_ptr.dtype.element_ty)
        if RESIDUAL:  # + residual, rounded like a separate add; the tile's part of each row's sum of squares
            r = tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=mask_o, other=0.0)
            y = (y.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)
            yf = tl.where(mask_o, y.to(tl.float32), 0.0)
            tl.store(sq_out_ptr + offs_m * tl.num_programs(0) + pid, tl.sum(yf * yf, 1), mask=mask_m)
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y, mask=mask_o)
    pdl_exit(USE_GDC)


small_m_linear_kernel = Kernel(_small_m_linear_kernel)

_SCRATCH: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_RETIRED: list[tuple[torch.Tensor, torch.Tensor]] = []


def split_scratch(device: torch.device, partial_elements: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-K partials (fp32) and arrival counters (int32, all 0 between launches) of ``device``: one
    pair shared by every call (launches on one stream run one after another; each leaves its counters
    at 0), grown when a call needs more. Growing moves them (the old pair is kept alive, not reused), so
    the first call of each shape should come before a CUDA-graph capture (the engine's warm-up forwards)."""
    part, arrivals = _SCRATCH.get(device, (None, None))
    if part is None or part.numel() < partial_elements or arrivals.numel() < tiles:
        size = max(partial_elements, 0 if part is None else part.numel())
        count = max(tiles, 0 if arrivals is None else arrivals.numel())
        if device in _SCRATCH:
            _RETIRED.append(_SCRATCH[device])  # a graph captured before may still point at them
        part = torch.empty(size, dtype=torch.float32, device=device)
        arrivals = torch.zeros(count, dtype=torch.int32, device=device)
        _SCRATCH[device] = (part, arrivals)
    return part, arrivals


def small_m_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: dict,
    *,
    gated: bool = False,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Inputs checked by ``sparse_kernels.linear``; ``x`` is 2-D with unit stride on K.

    ``config``: ``USE_DOT``, ``BLOCK_N``, ``BLOCK_K``, ``num_warps``, ``num_stages`` (``BLOCK_M`` is
    derived from M: the next power of two, at least 16 for ``tl.dot``). ``gated``: ``x`` is
    ``[M, 2K]`` (gate | up); ``norm``: ``(squares [M, tiles_in] fp32, norm weight [K], eps)``;
    ``residual``: ``[M, N]``, then returns ``(out, squares [M, tiles])``.
    """
    from sparse_kernels._triton.launch import dot_args

    m = x.shape[0]
    k = weight.shape[1]
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    use_dot = bool(config["USE_DOT"])
    block_m = max(16 if use_dot else 1, triton.next_power_of_2(m))
    tiles = triton.cdiv(n, config["BLOCK_N"])
    split_k = min(config.get("SPLIT_K", 1), triton.cdiv(k, config["BLOCK_K"]))
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), config["BLOCK_K"]) * config["BLOCK_K"]
    split_k = triton.cdiv(k, k_per_split)  # every split non-empty
    part, arrivals = (
        (out, out) if split_k == 1 else split_scratch(x.device, tiles * split_k * block_m * config["BLOCK_N"], tiles)
    )
    squares = torch.empty(m, tiles, dtype=torch.float32, device=x.device) if residual is not None else None
    sq_in, norm_weight, eps = norm if norm is not None else (out, weight, 0.0)
    small_m_linear_kernel[(tiles, split_k)](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        part,
        arrivals,
        residual if residual is not None else out,
        squares if squares is not None else out,
        norm_weight,
        sq_in,
        sq_in.shape[-1],
        eps,
        m,
        n,
        k,
        k_per_split,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        residual.stride(0) if residual is not None else 0,
        HAS_BIAS=bias is not None,
        GATED=gated,
        NORM=norm is not None,
        RESIDUAL=residual is not None,
        BLOCK_T=max(2, triton.next_power_of_2(sq_in.shape[-1])) if norm is not None else 2,
        USE_DOT=use_dot,
        SPLIT_K=split_k,
        BLOCK_M=block_m,
        BLOCK_N=config["BLOCK_N"],
        BLOCK_K=config["BLOCK_K"],
        **dot_args(weight.dtype, weight.device),
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
        **pdl_args(x.device),
    )
    return out if residual is None else (out, squares)
