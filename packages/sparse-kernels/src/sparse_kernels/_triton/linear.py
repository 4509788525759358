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
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
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
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
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
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: dict
) -> torch.Tensor:
    """Inputs checked by ``sparse_kernels.linear``; ``x`` is 2-D with unit stride on K.

    ``config``: ``USE_DOT``, ``BLOCK_N``, ``BLOCK_K``, ``num_warps``, ``num_stages`` (``BLOCK_M`` is
    derived from M: the next power of two, at least 16 for ``tl.dot``).
    """
    from sparse_kernels._triton.launch import dot_args

    m, k = x.shape
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
        HAS_BIAS=bias is not None,
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
    return out
