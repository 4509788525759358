"""Per token, the largest attention probability any query head gives it: ``max_h softmax(logits[b, h])_j``,
from logits and their log-sum-exp per head, with always-kept tokens forced to ``+inf`` and tokens past
the row to ``-inf`` (so a top-k over the output picks a selection). OmniKV's token score; one pass
over the logits instead of a softmax, a reduction over heads and masking passes. Graph-safe.
"""

from __future__ import annotations

import torch

from sparse_kernels._backend import resolve_backend


def head_max_probs(
    logits: torch.Tensor,
    logit_lse: torch.Tensor,
    kv_lens: torch.Tensor,
    out: torch.Tensor,
    *,
    sink: int = 0,
    recent: int = 0,
    backend: str = "auto",
) -> torch.Tensor:
    """Write float32 ``out[b, j]`` (``[B, W]``) and return it.

    ``logits``: float32 ``[B, H, W]`` contiguous; ``logit_lse``: float32 ``[B, H]``, each head's log-sum-exp
    over the row's tokens (the decode's ``lse_out``, or ``max + log(sum)`` of ``softmax_stats``); ``kv_lens``:
    int ``[B]``. Token ``j`` of row ``b`` scores ``max_h exp(logits[b, h, j] - logit_lse[b, h])``; ``j < sink`` and
    ``kv_lens[b] - recent <= j < kv_lens[b]`` score ``+inf``, ``j >= kv_lens[b]`` ``-inf``.
    """
    batch, heads, width = logits.shape
    if logits.dtype != torch.float32 or not logits.is_contiguous():
        raise ValueError("logits must be contiguous float32")
    if tuple(out.shape) != (batch, width) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be contiguous float32 [{batch}, {width}], got {out.dtype} {list(out.shape)}")
    if tuple(logit_lse.shape) != (batch, heads):
        raise ValueError(f"logit_lse must be [{batch}, {heads}]")
    if kv_lens.shape != (batch,):
        raise ValueError(f"kv_lens must be [{batch}]")
    if out.numel() == 0:
        return out
    if resolve_backend(backend, logits.device) == "triton":
        from sparse_kernels._triton.head_max_probs import head_max_probs_triton

        return head_max_probs_triton(logits, logit_lse, kv_lens, out, sink, recent)
    probs = torch.exp(logits - logit_lse[..., None])
    scores = probs.amax(1)
    tok = torch.arange(width, device=logits.device)[None, :]
    lens = kv_lens.to(torch.int64)[:, None]
    forced = (tok < sink) | ((tok >= lens - recent) & (tok < lens))
    out.copy_(scores.masked_fill(forced, float("inf")).masked_fill(tok >= lens, float("-inf")))
    return out
