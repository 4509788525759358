"""The seam between model code and the engine's attention.

Model code computes q, k and v and hands them to an ``AttentionBackend`` passed explicitly into
``forward``, with the rotary embedding still to apply (``sparse_kernels.Rotation``: positions, angle
table, Qwen3's per-head norms): the backend rotates q and k, and may do it in the launch that stores the
keys. Model code never knows whether the KV lives in a paged pool, which kernel runs, or whether a
sparse method reads only part of it. The engine
(``sparse-serve``) supplies the paged implementation; ``ContiguousCausalAttention`` in this
package is a plain one for running a model on whole sequences without an engine.
"""

from __future__ import annotations

from typing import Protocol

import torch

from sparse_kernels import Rotation


class AttentionBackend(Protocol):
    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        rotation: Rotation | None = None,
    ) -> torch.Tensor:
        """Attend the step's new tokens to their context.

        Parameters
        ----------
        layer_idx : index of the decoder layer (0-based).
        q : [num_tokens, num_q_heads, head_dim], post-RoPE, or before it when ``rotation`` is given.
        k, v : [num_tokens, num_kv_heads, head_dim], keys like ``q``; the backend stores them (rotated).
        scale : softmax scale (usually head_dim ** -0.5).
        rotation : the rotary embedding to apply to ``q`` and ``k`` first (``rotation.apply(q, k)``), which
            the backend may fuse with its store; None when they arrive rotated (or the model has none).

        Returns
        -------
        [num_tokens, num_q_heads, head_dim] in q's dtype.
        """
        ...
