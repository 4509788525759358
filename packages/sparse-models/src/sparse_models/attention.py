"""The seam between model code and the engine's attention.

Model code computes q, k and v (RoPE already applied to q and k) and hands them to an
``AttentionBackend`` passed explicitly into ``forward``; it never knows whether the KV lives in a
paged pool, which kernel runs, or whether a sparse method reads only part of it. The engine
(``sparse-serve``) supplies the paged implementation; ``ContiguousCausalAttention`` in this
package is a plain one for running a model on whole sequences without an engine.
"""

from __future__ import annotations

from typing import Protocol

import torch


class AttentionBackend(Protocol):
    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Attend the step's new tokens to their context.

        Parameters
        ----------
        layer_idx : index of the decoder layer (0-based).
        q : [num_tokens, num_q_heads, head_dim], post-RoPE.
        k, v : [num_tokens, num_kv_heads, head_dim], post-RoPE keys; the backend stores them.
        scale : softmax scale (usually head_dim ** -0.5).

        Returns
        -------
        [num_tokens, num_q_heads, head_dim] in q's dtype.
        """
        ...
