"""Attention over whole sequences laid out flat, with no KV kept: the engine-free backend.

Used by tests (parity with HF) and by anyone who wants to run a model on complete prompts without
a KV pool. Each call sees every token of every sequence, so causality within a sequence is all the
context there is; nothing is stored between calls.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sparse_kernels import Rotation


class ContiguousCausalAttention:
    """Causal (optionally sliding-window) GQA attention for a varlen batch, softmax in fp32.

    Parameters
    ----------
    cu_seqlens : [B + 1] int, sequence ``b`` owns flat tokens ``cu_seqlens[b] : cu_seqlens[b + 1]``.
    sliding_window : None (full causal), one window for all layers, or one entry per layer (e.g.
        ``config.layer_sliding_windows``). A window ``W`` lets a query see its ``W`` most recent
        tokens, itself included (HF's convention).
    """

    def __init__(
        self, cu_seqlens: torch.Tensor | Sequence[int], sliding_window: int | Sequence[int | None] | None = None
    ):
        bounds = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
        if not bounds or bounds[0] != 0 or any(b > e for b, e in zip(bounds, bounds[1:], strict=False)):
            raise ValueError(f"cu_seqlens must start at 0 and not decrease, got {bounds}")
        self.bounds = bounds  # host copy: the per-sequence loop slices on the host
        self.sliding_window = sliding_window

    def _window(self, layer_idx: int) -> int | None:
        if self.sliding_window is None or isinstance(self.sliding_window, int):
            return self.sliding_window
        return self.sliding_window[layer_idx]

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        rotation: Rotation | None = None,
    ) -> torch.Tensor:
        """``q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv] -> [T, Hq, Dv]``; see ``AttentionBackend.forward``."""
        if rotation is not None:
            q, k = rotation.apply(q, k)
        num_tokens, num_heads, _ = q.shape
        if num_tokens != self.bounds[-1]:
            raise ValueError(f"got {num_tokens} tokens but cu_seqlens covers {self.bounds[-1]}")
        group = num_heads // k.shape[1]  # q heads per KV head; q head h reads KV head h // group
        window = self._window(layer_idx)
        out = q.new_empty(num_tokens, num_heads, v.shape[2])
        for start, end in zip(self.bounds, self.bounds[1:], strict=False):
            if start == end:
                continue
            qs = q[start:end].transpose(0, 1)  # [Hq, L, D]
            ks = k[start:end].transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, L, D]
            vs = v[start:end].transpose(0, 1).repeat_interleave(group, dim=0)
            scores = (qs.float() @ ks.float().transpose(1, 2)) * scale  # [Hq, L, L]
            scores.masked_fill_(~_visible(end - start, window, q.device), float("-inf"))
            probs = scores.softmax(dim=-1).to(v.dtype)
            out[start:end] = (probs @ vs).transpose(0, 1)
        return out


def _visible(length: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[L, L] bool: query i sees key j iff ``j <= i`` (and ``j > i - window``)."""
    i = torch.arange(length, device=device)[:, None]
    j = torch.arange(length, device=device)[None, :]
    mask = j <= i
    if window is not None:
        mask &= j > i - window
    return mask
