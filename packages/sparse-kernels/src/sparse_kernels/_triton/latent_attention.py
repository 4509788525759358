"""Triton paged attention over a latent (MLA) cache: every query head against one shared KV row.

The cache row of a token is ``[c_kv (LATENT) | k_rope (ROPE)]``; the score of query row ``q`` is
``q[:LATENT] . c_kv + q[LATENT:] . k_rope`` and the value is ``c_kv`` itself, so a program loads each
cache row once for all the query rows it holds. Query rows are a request's (token, head) pairs
flattened token-major: row ``r`` is token ``r // NUM_HEADS``, head ``r % NUM_HEADS``. One program
takes ``BLOCK_M`` consecutive rows of one request (its tile, from the plan) and one split of the
request's keys; decode plans one tile per request and several splits (flash-decoding), prefill one
split and as many tiles as the rows need.

``DECODE`` (every request one query token): the grid is ``(batch * TILES_PER_REQ, num_splits)`` and
a program finds its request and heads from its index alone, so a decode launch reads only the CSR
and its grid depends on the batch size alone (a CUDA graph replays it for any step of that size).
A request of ``L`` keys uses ``min(num_splits, cdiv(L, min_split_keys))`` of the splits, decided on
the device: the programs past them return after marking their rows dead.

With ``SPLIT`` the program writes its divided partial output and its base-2 log-sum-exp per row
(``-inf`` where it saw no key: its partial output is then not written), and ``_latent_merge_kernel``
(one launch, one program per row and 128 output columns) weighs the splits into the output;
without, the program writes the final output. The next step's page ids are loaded one step
ahead, so each step's row loads do not wait on its page-id load.
Token ``j`` of a request is pool slot ``indices[start + j // PAGE_SIZE] * PAGE_SIZE + j % PAGE_SIZE``.
Causal: query token ``t`` of a request with ``n`` new tokens and ``L`` keys sees keys ``<= L - n + t``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_kernels._triton.launch import Kernel, dot_args


def _latent_attention_kernel(
    q_ptr,
    cache_ptr,
    qo_indptr_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    kv_last_len_ptr,
    tile_req_ptr,
    tile_row_ptr,
    out_ptr,
    o_part_ptr,
    lse_part_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    scale_log2,
    num_splits,
    min_split_keys,
    NUM_HEADS: tl.constexpr,
    LATENT: tl.constexpr,
    ROPE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr,
    SPLIT: tl.constexpr,
    DECODE: tl.constexpr,
    TILES_PER_REQ: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    if DECODE:  # one query token per request, TILES_PER_REQ tiles of heads each
        req = tile // TILES_PER_REQ
        row0 = (tile % TILES_PER_REQ) * BLOCK_M
        q_lo = req
        qo_len = 1
    else:
        req = tl.load(tile_req_ptr + tile)
        row0 = tl.load(tile_row_ptr + tile)
        q_lo = tl.load(qo_indptr_ptr + req)
        qo_len = tl.load(qo_indptr_ptr + req + 1) - q_lo
    page_lo = tl.load(kv_indptr_ptr + req)
    page_hi = tl.load(kv_indptr_ptr + req + 1)
    kv_len = (page_hi - page_lo - 1) * PAGE_SIZE + tl.load(kv_last_len_ptr + req)

    rows = row0 + tl.arange(0, BLOCK_M)
    mask_m = rows < qo_len * NUM_HEADS
    tok = rows // NUM_HEADS
    head = rows % NUM_HEADS
    last_key = kv_len - qo_len + tok  # causal bound per row
    if CAUSAL:
        tile_last_tok = tl.minimum(row0 + BLOCK_M - 1, qo_len * NUM_HEADS - 1) // NUM_HEADS
        hi_all = tl.minimum(kv_len, kv_len - qo_len + tile_last_tok + 1)
    else:
        hi_all = kv_len
    splits = tl.maximum(tl.minimum(num_splits, tl.cdiv(hi_all, min_split_keys)), 1)  # this request's
    chunk = tl.cdiv(tl.cdiv(hi_all, splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, hi_all)
    g_rows = (q_lo + tok).to(tl.int64) * NUM_HEADS + head  # the row in the whole batch
    if SPLIT:
        if split >= splits:  # a split this request does not use: its rows saw no key
            dead = tl.full([BLOCK_M], float("-inf"), tl.float32)
            tl.store(lse_part_ptr + g_rows * num_splits + split, dead, mask=mask_m)
            return

    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    mask_c = offs_c < LATENT
    mask_r = offs_r < ROPE
    q_rows = q_ptr + (q_lo + tok).to(tl.int64) * stride_qt + head * stride_qh
    q_c = tl.load(q_rows[:, None] + offs_c[None, :], mask=mask_m[:, None] & mask_c[None, :], other=0.0)
    q_r = tl.load(q_rows[:, None] + LATENT + offs_r[None, :], mask=mask_m[:, None] & mask_r[None, :], other=0.0)
    q_c = q_c.to(DOT_DTYPE)
    q_r = q_r.to(DOT_DTYPE)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_C], tl.float32)
    offs_n = lo + tl.arange(0, BLOCK_N)
    page_next = tl.load(kv_indices_ptr + page_lo + offs_n // PAGE_SIZE, mask=offs_n < hi, other=0)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        page = page_next
        ahead = offs_n + BLOCK_N  # the next step's page ids, loaded while this step's rows stream in
        page_next = tl.load(kv_indices_ptr + page_lo + ahead // PAGE_SIZE, mask=ahead < hi, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE  # int64: large pools
        row_ptr = cache_ptr + slot * (LATENT + ROPE)
        kv_c = tl.load(row_ptr[:, None] + offs_c[None, :], mask=mask_n[:, None] & mask_c[None, :], other=0.0)
        kv_r = tl.load(row_ptr[:, None] + LATENT + offs_r[None, :], mask=mask_n[:, None] & mask_r[None, :], other=0.0)
        kv_c = kv_c.to(DOT_DTYPE)
        qk = tl.dot(q_c, tl.trans(kv_c), input_precision=PRECISION)
        qk = tl.dot(q_r, tl.trans(kv_r.to(DOT_DTYPE)), qk, input_precision=PRECISION)  # accumulates in place
        qk = qk * scale_log2  # [BLOCK_M, BLOCK_N], base 2
        seen = mask_n[None, :]
        if CAUSAL:
            seen = seen & (offs_n[None, :] <= last_key[:, None])
        qk = tl.where(seen, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: no NaN
        p = tl.exp2(qk - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(DOT_DTYPE), kv_c, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    if SPLIT:
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        part = (g_rows * num_splits + split) * LATENT
        live = mask_m & (l_i > 0)  # the merge reads no dead row's partial
        tl.store(o_part_ptr + part[:, None] + offs_c[None, :], out, mask=live[:, None] & mask_c[None, :])
        tl.store(lse_part_ptr + g_rows * num_splits + split, lse, mask=mask_m)
    else:
        o_rows = out_ptr + (q_lo + tok).to(tl.int64) * stride_ot + head * stride_oh
        tl.store(
            o_rows[:, None] + offs_c[None, :], out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_c[None, :]
        )


def _latent_merge_kernel(
    o_part_ptr,
    lse_part_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    num_splits,
    NUM_HEADS: tl.constexpr,
    LATENT: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """One program per (row, ``BLOCK_C`` output columns), the splits in chunks of ``BLOCK_S``: a
    batch of one still spreads over many programs, and no tile holds every split at once."""
    row = tl.program_id(0).to(tl.int64)  # token * NUM_HEADS + head over the whole batch
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < LATENT
    top = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        lse = tl.load(lse_part_ptr + row * num_splits + offs_s, mask=offs_s < num_splits, other=float("-inf"))
        top = tl.maximum(top, lse)
    top = tl.maximum(tl.max(top, 0), -1e30)  # every split dead: weights 0, output 0
    acc = tl.zeros([BLOCK_C], tl.float32)
    total = tl.zeros([BLOCK_S], tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        lse = tl.load(lse_part_ptr + row * num_splits + offs_s, mask=offs_s < num_splits, other=float("-inf"))
        w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - top))  # dead splits weigh 0
        part = o_part_ptr + (row * num_splits + offs_s)[:, None] * LATENT + offs_c[None, :]
        o = tl.load(part, mask=(w > 0)[:, None] & mask_c[None, :], other=0.0)  # dead splits are not read
        acc += tl.sum(o * w[:, None], 0)
        total += w
    o = acc / tl.maximum(tl.sum(total, 0), 1e-30)
    dst = out_ptr + (row // NUM_HEADS) * stride_ot + (row % NUM_HEADS) * stride_oh + offs_c
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=mask_c)


# The merge's tile: output columns per program and splits per step (a 32 x 128 fp32 tile).
MERGE_BLOCK_C = 128
MERGE_BLOCK_S = 32

latent_attention_kernel = Kernel(_latent_attention_kernel)
latent_merge_kernel = Kernel(_latent_merge_kernel)


def run_latent_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    plan,
    out: torch.Tensor,
    o_part: torch.Tensor | None,
    lse_part: torch.Tensor | None,
    merge: bool = True,
) -> None:
    """Launch over ``plan`` (a ``sparse_kernels.latent_attention.LatentPlan``); inputs already checked.

    ``q [T, H, LATENT + ROPE]`` (unit stride last dim), ``cache [num_blocks, block_size, 1, LATENT + ROPE]``
    contiguous, ``out [T, H, LATENT]``; with ``plan.num_splits > 1`` the partials go to the scratch
    ``o_part [T * H, splits, LATENT]`` fp32 and ``lse_part [T * H, splits]`` fp32, then one merge
    launch writes ``out`` (``merge=False`` leaves the partials to the caller: the probe's plain merge).
    """
    split = plan.num_splits > 1
    dummy = out if not split else o_part
    latent_attention_kernel[(plan.num_tiles, plan.num_splits)](
        q,
        cache,
        plan.qo_indptr,
        plan.kv_indptr,
        plan.kv_indices,
        plan.kv_last_len,
        plan.tile_req,  # decode plans: unused
        plan.tile_row,
        out,
        dummy if o_part is None else o_part,
        dummy if lse_part is None else lse_part,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        plan.sm_scale * 1.4426950408889634,
        plan.num_splits,
        plan.min_split_keys,
        NUM_HEADS=plan.num_heads,
        LATENT=plan.latent_dim,
        ROPE=plan.rope_dim,
        PAGE_SIZE=plan.block_size,
        CAUSAL=plan.causal,
        SPLIT=split,
        DECODE=plan.decode,
        TILES_PER_REQ=plan.tiles_per_request,
        BLOCK_M=plan.block_m,
        BLOCK_C=max(16, triton.next_power_of_2(plan.latent_dim)),
        BLOCK_R=max(16, triton.next_power_of_2(plan.rope_dim)),
        BLOCK_N=plan.block_n,
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
        **dot_args(q.dtype, q.device),
    )
    if split and merge:
        block_c = min(MERGE_BLOCK_C, max(16, triton.next_power_of_2(plan.latent_dim)))
        latent_merge_kernel[(q.shape[0] * q.shape[1], triton.cdiv(plan.latent_dim, block_c))](
            o_part,
            lse_part,
            out,
            out.stride(0),
            out.stride(1),
            plan.num_splits,
            NUM_HEADS=plan.num_heads,
            LATENT=plan.latent_dim,
            BLOCK_S=min(MERGE_BLOCK_S, max(2, triton.next_power_of_2(plan.num_splits))),
            BLOCK_C=block_c,
            num_warps=4,
        )
