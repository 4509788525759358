"""Cascade prefill: a chunk's attention split at a page boundary into its cached prefix and the rest.

Every query of a chunk sees the whole cached prefix, so that part needs no mask: it is a plain dense
attention over the prefix's pages (read in place when they are one ascending run of pool blocks, else
gathered), run on CUDA by cuDNN's fused attention (through torch's ``_scaled_dot_product_cudnn_attention``,
which also returns the log-sum-exp and takes GQA's fewer KV heads as they are). Queries, keys and values
go in as strided views of their token-major tensors and the output comes back token-major, so nothing is
copied around the call. The rest (the chunk's own keys and the prefix past the last whole step) runs in
the paged Triton kernel with the causal mask, and the two partial softmaxes are merged by their
log-sum-exps in one launch (``merge_states_``), as FlashInfer's cascade attention does. Where that rest is
exactly the chunk's own keys (whole pages, as many as its queries, a bucket's size: every chunk of a long
prompt in chunked prefill) it is a causal square, which cuDNN runs too: its causal mask is top-left aligned,
which on a square is the sequence-end alignment the chunk needs. The plain formula below is the reference
for every part and the fallback off CUDA.
"""

from __future__ import annotations

import functools

import torch

# cuDNN builds an execution plan for every new shape, which costs the host tens of milliseconds: in
# serving, where every chunk has its own prefix length, that cost dominated the step (measured on the
# H200: the agent benchmark's mixed steps spent 70-90 ms more on the host than before the cascade). So
# shapes are made to repeat: the fused part takes the largest multiple of CASCADE_PREFIX_STEP tokens of
# the prefix (whole pages; the paged kernel reads the rest), and its queries are padded with zero rows
# to a power of two (at least CASCADE_MIN_QUERIES). A chunk with fewer queries, or a prefix shorter than
# one step, runs in the paged kernel alone (as fast there; measured on the H200). The step is the default
# chunk: chunked prefill then hands cuDNN the whole prefix (the paged kernel runs at ~250 TFLOP/s on what it
# gets, cuDNN at ~660; session 26: a new shape's plan costs ~35 ms once per process).
CASCADE_PREFIX_STEP = 2048
CASCADE_MIN_QUERIES = 128
FUSED_DTYPES = (torch.bfloat16, torch.float16)
# Tests set this to run the split off CUDA too (prefix part by the plain formula).
SPLIT_WITHOUT_FUSED = False
# A chunk's causal square in the fused attention (``squares``); False: in the paged kernel (benchmarks A/B it).
CASCADE_SQUARES = True


def prefix_pages(qo_lens: torch.Tensor, kv_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """int64 ``[B]``: the whole pages of each request's cached prefix that the split reads (0: none)."""
    prefix = kv_lens.long() - qo_lens.long()
    pages = prefix // CASCADE_PREFIX_STEP * CASCADE_PREFIX_STEP // block_size
    take = qo_lens.long() >= CASCADE_MIN_QUERIES
    return torch.where(take, pages, torch.zeros_like(pages))


def squares(qo_lens: torch.Tensor, kv_lens: torch.Tensor, pages: torch.Tensor, block_size: int) -> torch.Tensor:
    """bool ``[B]``: the requests whose keys past their ``pages`` split pages are exactly their queries' own, in
    whole pages, as many as a query bucket (so the fused attention runs that part as a causal square whose
    shape repeats)."""
    rest = kv_lens.long() - pages.long() * block_size
    qo = qo_lens.long()
    bucket = (qo >= CASCADE_MIN_QUERIES) & ((qo & (qo - 1)) == 0)
    take = (rest == qo) & (rest % block_size == 0) & bucket
    return take & CASCADE_SQUARES


def query_bucket(num_queries: int) -> int:
    """Rows the fused part runs for ``num_queries`` queries: the next power of two, at least
    ``CASCADE_MIN_QUERIES`` (the extra rows are zeros whose outputs are dropped)."""
    return max(CASCADE_MIN_QUERIES, 1 << (num_queries - 1).bit_length())


@functools.cache
def fused_available(device_index: int) -> bool:
    """Whether cuDNN's fused attention runs here (a tiny call, once per device)."""
    try:
        q = torch.zeros(1, 1, 8, 64, dtype=torch.bfloat16, device=f"cuda:{device_index}")
        torch.ops.aten._scaled_dot_product_cudnn_attention(q, q, q, None, True, 0.0, False, False, scale=0.125)
    except (RuntimeError, AttributeError):
        return False
    return True


def use_fused(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in FUSED_DTYPES and q.shape[-1] <= 128 and fused_available(q.device.index or 0)


def use_split(q: torch.Tensor) -> bool:
    """Whether a planned split runs for queries like ``q`` (else the paged kernel takes every key)."""
    return use_fused(q) or SPLIT_WITHOUT_FUSED


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, *, causal: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q [T, Hq, D]`` over ``k, v [N, Hkv, D]`` (GQA): ``(out, lse)``.

    ``out`` is ``[T, Hq, D]`` in ``q``'s dtype; ``lse`` ``[T, Hq]`` float32, the natural-log
    log-sum-exp of each row's scaled scores. Fused (cuDNN) where ``use_fused(q)``, else plain torch;
    unmasked, either runs ``query_bucket(T)`` rows (``q`` padded with zeros) so that shapes repeat.
    ``causal``: a square (``N == T == query_bucket(T)``, else ValueError) where query ``i`` sees keys ``<= i``.
    """
    rows = q.shape[0]
    if causal:
        if k.shape[0] != rows or query_bucket(rows) != rows:
            raise ValueError(f"a causal part must be a square of a bucket's size: {rows} queries, {k.shape[0]} keys")
        return _attention_with_lse(q, k, v, sm_scale, True)
    if query_bucket(rows) != rows:
        q = torch.cat([q, q.new_zeros(query_bucket(rows) - rows, *q.shape[1:])])
    out, lse = _attention_with_lse(q, k, v, sm_scale, False)
    return out[:rows], lse[:rows]


def _attention_with_lse(q, k, v, sm_scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    t, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    if use_fused(q):
        # [1, heads, tokens, D] views of the token-major tensors (no copies); cuDNN returns its output in
        # q's token-major order and its LSE as [1, Hq, T(, 1)]. Its causal mask is top-left aligned.
        qf, kf, vf = (x.unsqueeze(0).transpose(1, 2) for x in (q, k, v))
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(
            qf, kf, vf, None, True, 0.0, causal, False, scale=sm_scale
        )  # fmt: skip
        return res[0][0].transpose(0, 1), res[1].view(hq, t).T.float()
    kk = k.float().repeat_interleave(group, dim=1)
    vv = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("thd,nhd->htn", q.float(), kk) * sm_scale
    if causal:
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [Hq, T]
    out = torch.einsum("htn,nhd->thd", torch.exp(s - lse[..., None]), vv)
    return out.to(q.dtype), lse.T.contiguous()


def warm_plans(
    num_queries: int,
    max_prefix: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    sm_scale: float | None = None,
    max_shapes: int = 64,
) -> int:
    """Build cuDNN's plans for the prefix shapes that chunks of ``num_queries`` queries meet on prompts of up
    to ``max_prefix`` cached tokens (each multiple of ``CASCADE_PREFIX_STEP``, at most ``max_shapes`` of
    them, the shortest first), and the causal squares of every bucket up to ``num_queries`` (a prompt of a
    bucket's size is one); returns how many were built (0 where the fused attention does not run).

    A plan is built on a shape's first call and kept for the process (~35 ms each on an H200, session 26);
    the first 128K prompt otherwise pays ~2 s of them inside its prefill. The keys and values are zeros
    (their values do not matter to a plan) and are freed on return; ``sm_scale`` (default ``head_dim ** -0.5``)
    is the model's, as its chunks will pass it.
    """
    device = torch.device(device)
    rows = query_bucket(num_queries)
    if num_queries < CASCADE_MIN_QUERIES or max_prefix < CASCADE_PREFIX_STEP:
        return 0
    q = torch.zeros(rows, num_q_heads, head_dim, dtype=dtype, device=device)
    if not use_fused(q):
        return 0
    lengths = range(CASCADE_PREFIX_STEP, max_prefix + 1, CASCADE_PREFIX_STEP)[:max_shapes]
    kv = torch.zeros(2, max(lengths[-1], rows), num_kv_heads, head_dim, dtype=dtype, device=device)
    scale = head_dim**-0.5 if sm_scale is None else sm_scale
    for n in lengths:
        attention_with_lse(q, kv[0, :n], kv[1, :n], scale)
    built = len(lengths)
    side = CASCADE_MIN_QUERIES
    while CASCADE_SQUARES and side <= num_queries:
        attention_with_lse(q[:side], kv[0, :side], kv[1, :side], scale, causal=True)
        built, side = built + 1, side * 2
    return built
