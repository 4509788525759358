"""Triton ``rope_qk`` and ``rope_store``: one program per tile of ``BLOCK_T`` consecutive tokens and one
head, over the q heads then the k heads.

Each program loads its tokens' two halves of its head as ``[BLOCK_T, BLOCK]`` tiles, optionally
RMS-normalises each row (Qwen3's q/k norm), looks each token's angles up in the table and writes the
rotated rows to a contiguous output. Casts sit where the reference rounds (see ``sparse_kernels.rope``).
Decode-sized steps launch one token a program (``BLOCK_T = 1``: a ``[1, BLOCK]`` tile, the same math);
prefill chunks take a tile of tokens per program (``_token_tile``), which rounds at the same points.

With ``STORE`` (``rope_store``) a k-head program writes its rotated rows straight into the paged pool at
their tokens' slots instead of ``k_out``, and copies the tokens' v rows there too (nothing for slot ``-1``);
with ``COPY`` a q-head program also writes the rotated rows of tokens ``t < num_copy`` to rows
``copy_index[t]`` of ``copy_into``: what ``store_kv`` would do after ``rope_qk``, in the same launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_kernels._triton.launch import Kernel, pdl_args, pdl_enter, pdl_exit

# Steps of at least this many tokens launch TILE_TOKENS tokens a program; shorter ones (decode, T = 1..32)
# one token a program, as before tiling. Tests set TILE_MIN_TOKENS to force either launch (the probe,
# benchmarks/rope_probe.py, replaces _token_tile).
TILE_MIN_TOKENS = 64
TILE_TOKENS = 8


def _token_tile(num_tokens: int, half: int) -> tuple[int, int]:
    """``(BLOCK_T, num_warps)`` for a step of ``num_tokens`` tokens and heads of ``2 * half``.

    Short steps keep the one-token launch decode was measured with (``T x (Hq + Hkv)`` programs of one
    warp, two from head_dim 256; ~2 us a call). Longer ones stack that program ``TILE_TOKENS`` times: a
    tile of 8 tokens with 8 times the warps, so each row keeps the one-token program's layout (head_dim
    128: 2 elements a thread, one warp a row; on sm_90 Triton 3.9 lays the norm's sums out as
    ``sizePerThread [1, 2], threadsPerWarp [1, 32], warpsPerCTA [8, 1]`` against ``[1, 1]``) and sums its
    squares in the same order: the same bits as the one-token launch on the GPU too. A tile read with
    16-byte accesses (``[16, 64]``, 4 warps) would sum in another order. At T = 2048 (Qwen3-8B) that is
    10240 programs of 8 warps instead of 81920 of one, which could not fill an SM's 64 warps (32 programs
    at most). NOT yet measured on a GPU: the threshold and the tile are a first guess
    (``benchmarks/rope_probe.py`` times both launches).
    """
    warps = 1 if half <= 64 else 2
    if num_tokens < TILE_MIN_TOKENS:
        return 1, warps
    return TILE_TOKENS, TILE_TOKENS * warps


def _rope_qk_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    qw_ptr,
    kw_ptr,
    pos_ptr,
    cos_sin_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    copy_into_ptr,
    copy_index_ptr,
    num_tokens,
    num_copy,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cs,
    eps,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
    STORE: tl.constexpr,
    COPY: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    head = tl.program_id(1)
    is_q = head < NUM_Q_HEADS
    kv_head = head - NUM_Q_HEADS  # negative for q heads
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # the tile's tokens
    live = rows < num_tokens  # the last tile's rows past T load and store nothing
    offs = tl.arange(0, BLOCK)[None, :]
    cols = offs < HALF
    # Masks are a per-row condition broadcast over the columns, ``&`` the columns' (both tensors: the
    # interpreter's ``&`` of a vector and a scalar mask yields integers, which it refuses as a mask; and a
    # per-row limit compared with ``offs`` would stop the compiler from vectorising the accesses).
    # ``writes``: the rows whose rotated head this program writes.
    writes = live
    # Step metadata from the host (read before the wait, like the positions below): the tokens' pool
    # slots, and for the first num_copy tokens' q heads the rows of copy_into they go to.
    if STORE:
        slot = tl.load(slot_ptr + rows, mask=live, other=-1).to(tl.int64)
        # A k-head row of a padded token (slot -1) leaves the pool alone: it loads and stores nothing.
        writes = tl.where(is_q, live, slot >= 0)
        kv_mask = (tl.where(is_q, -1, slot) >= 0)[:, None] & cols
        kv_dst = slot * (NUM_KV_HEADS * 2 * HALF) + kv_head * (2 * HALF)  # int64: pools exceed 2**31 elements
    mask = writes[:, None] & cols
    if COPY:
        copies = tl.where(is_q, rows, num_copy) < num_copy  # num_copy is 0 when nothing is copied
        dest = tl.load(copy_index_ptr + rows, mask=copies, other=0).to(tl.int64)
        copy_mask = copies[:, None] & cols
    if is_q:
        src = q_ptr + rows * stride_qt + head * stride_qh
        dst = q_out_ptr + (rows * NUM_Q_HEADS + head) * (2 * HALF)
        w_ptr = qw_ptr
    else:
        src = k_ptr + rows * stride_kt + kv_head * stride_kh
        if STORE:
            dst = k_cache_ptr + kv_dst
        else:
            dst = k_out_ptr + (rows * NUM_KV_HEADS + kv_head) * (2 * HALF)
        w_ptr = kw_ptr
    src = src[:, None] + offs
    dst = dst[:, None] + offs
    dtype = q_ptr.dtype.element_ty
    # Positions (step metadata from the host), the angle table and the norm weights are read before
    # waiting for the kernel that wrote q and k.
    pos = tl.load(pos_ptr + rows, mask=live, other=0).to(tl.int64)
    angles = cos_sin_ptr + pos[:, None] * stride_cs + offs
    cos = tl.load(angles, mask=mask, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(angles + HALF, mask=mask, other=0.0).to(dtype).to(tl.float32)
    if HAS_NORM:
        w1 = tl.load(w_ptr + offs, mask=cols, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + offs, mask=cols, other=0.0).to(tl.float32)
    pdl_enter(USE_GDC)
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    if STORE:
        # The tokens' v rows (same dtype as the pool: a plain copy), loaded before any store: the pool's
        # pointers may alias the inputs' as far as the compiler knows.
        vsrc = v_ptr + (rows * stride_vt + kv_head * stride_vh)[:, None] + offs
        v1 = tl.load(vsrc, mask=kv_mask)
        v2 = tl.load(vsrc + HALF, mask=kv_mask)
    if HAS_NORM:
        sum_sq = tl.sum(x1 * x1, axis=1, keep_dims=True) + tl.sum(x2 * x2, axis=1, keep_dims=True)
        inv_rms = tl.math.rsqrt(sum_sq / (2 * HALF) + eps)
        x1 = (w1 * (x1 * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    o1 = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    o2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    tl.store(dst, o1.to(dtype), mask=mask)
    tl.store(dst + HALF, o2.to(dtype), mask=mask)
    if STORE:
        vdst = v_cache_ptr + kv_dst[:, None] + offs
        tl.store(vdst, v1, mask=kv_mask)
        tl.store(vdst + HALF, v2, mask=kv_mask)
    if COPY:
        cdst = copy_into_ptr + (dest * (NUM_Q_HEADS * 2 * HALF) + head * (2 * HALF))[:, None] + offs
        tl.store(cdst, o1.to(dtype), mask=copy_mask)
        tl.store(cdst + HALF, o2.to(dtype), mask=copy_mask)
    pdl_exit(USE_GDC)


rope_qk_kernel = Kernel(_rope_qk_kernel)


def rope_qk_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs checked by ``sparse_kernels.rope_qk``."""
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    return _launch(q, k, positions, cos_sin, q_weight, k_weight, eps, k_out=k_out), k_out


def rope_store_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    copy: tuple[torch.Tensor, torch.Tensor, int] | None,
) -> torch.Tensor:
    """Inputs checked by ``sparse_kernels.rope_store`` (v, the caches and ``copy_into`` in q's dtype).
    ``copy``: ``(copy_into [R, Hq, D], copy_index [>= n], n)`` with ``n > 0``, or None. Returns q_out."""
    if v.stride(2) != 1:
        v = v.contiguous()
    store = (v, k_cache, v_cache, slot_mapping)
    return _launch(q, k, positions, cos_sin, q_weight, k_weight, eps, store=store, copy=copy)


def _launch(q, k, positions, cos_sin, q_weight, k_weight, eps, *, k_out=None, store=None, copy=None) -> torch.Tensor:
    """One launch over ``cdiv(T, BLOCK_T) x (Hq + Hkv)`` programs; writes ``k_out``, or with ``store`` the pool.
    Returns q_out."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if q.stride(2) != 1:
        q = q.contiguous()
    if k.stride(2) != 1:
        k = k.contiguous()
    cos_sin = cos_sin if cos_sin.stride(1) == 1 else cos_sin.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    v, k_cache, v_cache, slot_mapping = store if store is not None else (k, k_out, k_out, positions)
    copy_into, copy_index, num_copy = copy if copy is not None else (q_out, positions, 0)
    has_norm = q_weight is not None
    half = head_dim // 2
    block_t, num_warps = _token_tile(num_tokens, half)
    rope_qk_kernel[(triton.cdiv(num_tokens, block_t), num_q_heads + num_kv_heads)](
        q,
        k,
        q_out,
        k_out if k_out is not None else k_cache,
        q_weight if has_norm else q,
        k_weight if has_norm else k,
        positions,
        cos_sin,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        copy_into,
        copy_index,
        num_tokens,
        num_copy,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos_sin.stride(0),
        eps,
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=half,
        HAS_NORM=has_norm,
        STORE=store is not None,
        COPY=copy is not None,
        BLOCK_T=block_t,
        BLOCK=triton.next_power_of_2(half),
        num_warps=num_warps,
        **pdl_args(q.device),
    )
    return q_out
