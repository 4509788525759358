"""Cascade prefill: a chunk's attention split at a page boundary into its cached prefix and the rest.

Every query of a chunk sees the whole cached prefix, so that part needs no mask: it is a plain dense
attention over a contiguous copy of the prefix's pages, run on CUDA by cuDNN's fused attention (through
torch's ``_scaled_dot_product_cudnn_attention``, which also returns the log-sum-exp) with the query
heads of each GQA group folded into rows (exact without a mask, and no K/V repeat). The rest (the
chunk's own keys and a partial last prefix page) runs in the paged Triton kernel with the causal mask,
and the two partial softmaxes are merged by their log-sum-exps, as FlashInfer's cascade attention does.
The plain formula below is the reference for both parts and the fallback off CUDA.
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
# one step, runs in the paged kernel alone (as fast there; measured on the H200).
CASCADE_PREFIX_STEP = 4096
CASCADE_MIN_QUERIES = 128
FUSED_DTYPES = (torch.bfloat16, torch.float16)
# Tests set this to run the split off CUDA too (prefix part by the plain formula).
SPLIT_WITHOUT_FUSED = False


def prefix_pages(qo_lens: torch.Tensor, kv_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """int64 ``[B]``: the whole pages of each request's cached prefix that the split reads (0: none)."""
    prefix = kv_lens.long() - qo_lens.long()
    pages = prefix // CASCADE_PREFIX_STEP * CASCADE_PREFIX_STEP // block_size
    take = qo_lens.long() >= CASCADE_MIN_QUERIES
    return torch.where(take, pages, torch.zeros_like(pages))


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
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked attention of ``q [T, Hq, D]`` over ``k, v [N, Hkv, D]`` (GQA): ``(out, lse)``.

    ``out`` is ``[T, Hq, D]`` in ``q``'s dtype; ``lse`` ``[T, Hq]`` float32, the natural-log
    log-sum-exp of each row's scaled scores. Fused (cuDNN) where ``use_fused(q)``, else plain torch;
    either runs ``query_bucket(T)`` rows (``q`` padded with zeros) so that shapes repeat.
    """
    rows = q.shape[0]
    if query_bucket(rows) != rows:
        q = torch.cat([q, q.new_zeros(query_bucket(rows) - rows, *q.shape[1:])])
    out, lse = _attention_with_lse(q, k, v, sm_scale)
    return out[:rows], lse[:rows]


def _attention_with_lse(q, k, v, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    t, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    if use_fused(q):
        # Rows (g, i) of KV head h: query i's head h * group + g; no mask, so the fold is exact.
        qf = q.view(t, hkv, group, d).permute(1, 2, 0, 3).reshape(1, hkv, group * t, d)
        kf, vf = (x.view(1, -1, hkv, d).transpose(1, 2) for x in (k, v))
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(
            qf, kf, vf, None, True, 0.0, False, False, scale=sm_scale
        )  # fmt: skip
        out = res[0].view(hkv, group, t, d).permute(2, 0, 1, 3).reshape(t, hq, d)
        lse = res[1].view(hkv, group, t).permute(2, 0, 1).reshape(t, hq)
        return out, lse.float()
    kk = k.float().repeat_interleave(group, dim=1)
    vv = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("thd,nhd->htn", q.float(), kk) * sm_scale
    lse = torch.logsumexp(s, dim=-1)  # [Hq, T]
    out = torch.einsum("htn,nhd->thd", torch.exp(s - lse[..., None]), vv)
    return out.to(q.dtype), lse.T.contiguous()


def merge_into(out: torch.Tensor, lse: torch.Tensor, other: torch.Tensor, other_lse: torch.Tensor) -> None:
    """``out`` (with ``lse``) becomes the softmax over both key sets, ``other`` holding the second part.

    ``out``/``other`` ``[T, H, D]``, ``lse``/``other_lse`` ``[T, H]`` float32 (natural log).
    """
    w = torch.sigmoid(other_lse - lse)[..., None]  # the other part's share of the total mass
    out.copy_(torch.lerp(out.float(), other.float(), w))
