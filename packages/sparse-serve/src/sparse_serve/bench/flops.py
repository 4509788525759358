"""Floating-point operations of prefill, counted from the model's shape (what TFLOP/s divides).

A matrix product of ``[m, k] @ [k, n]`` is ``2 * m * k * n`` FLOPs. Per layer and token: the q/k/v/o
projections and the gated MLP (gate, up, down). Causal attention over the cached prefix: a chunk of
``c`` queries at offset ``p`` scores query ``i`` (1-based) against ``p + i`` keys, for QK^T and again
for PV, so ``2 * 2 * head_dim * num_heads * (c * p + c * (c + 1) / 2)`` per layer (a sliding-window
layer: each query's keys capped at the window). The LM head runs
for the request's last prompt token only (one row). Norms, RoPE, activations, biases and softmax
are left out (a few per cent at most). Methods that drop KV during prefill are counted as dense:
the number is the dense-equivalent work, the same for every method.

Chunking does not change the total: the chunks of one prompt of ``L`` tokens sum to the attention of
one pass, ``L * (L + 1) / 2`` query-key pairs. A mixture-of-experts layer counts the router and the
``top_k`` experts each token runs; multi-head latent attention is not counted (NotImplementedError).
"""

from __future__ import annotations

from dataclasses import dataclass

from sparse_models import ModelConfig


@dataclass(frozen=True, slots=True)
class PrefillFlops:
    """FLOPs of one prefill chunk (or a whole prompt), by part."""

    projections: int  # q, k, v, o
    mlp: int  # gate, up, down
    attention: int  # QK^T and PV over the cached prefix and the chunk, causal
    lm_head: int  # the last token's logits

    @property
    def total(self) -> int:
        return self.projections + self.mlp + self.attention + self.lm_head


def prefill_flops(cfg: ModelConfig, num_tokens: int, prefix_len: int = 0, *, last_chunk: bool = True) -> PrefillFlops:
    """FLOPs of prefilling ``num_tokens`` tokens of one request after ``prefix_len`` cached ones.

    ``prefill_flops(cfg, L)`` is a whole prompt of ``L`` tokens; ``last_chunk`` adds the LM head's row.
    """
    if getattr(cfg, "mla", None) is not None:
        raise NotImplementedError("prefill FLOPs of multi-head latent attention are not counted")
    hidden, layers, d = cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim
    q_width, kv_width = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    per_token = 2 * hidden * (q_width + 2 * kv_width) + 2 * q_width * hidden
    pairs = sum(_attended_pairs(num_tokens, prefix_len, w) for w in cfg.layer_sliding_windows)
    return PrefillFlops(
        projections=layers * num_tokens * per_token,
        mlp=num_tokens * sum(_mlp_flops_per_token(cfg, layer) for layer in range(layers)),
        attention=2 * 2 * d * cfg.num_attention_heads * pairs,
        lm_head=2 * hidden * cfg.vocab_size if last_chunk else 0,
    )


def _mlp_flops_per_token(cfg: ModelConfig, layer: int) -> int:
    """Gate, up and down of the layer's MLP; a routed layer's router and ``top_k`` experts."""
    moe, kinds = getattr(cfg, "moe", None), getattr(cfg, "mlp_layer_types", ())
    if moe is not None and kinds and kinds[layer] == "sparse":
        return 2 * cfg.hidden_size * moe.num_experts + moe.top_k * 3 * 2 * cfg.hidden_size * moe.intermediate_size
    return 3 * 2 * cfg.hidden_size * cfg.intermediate_size


def _attended_pairs(num_tokens: int, prefix_len: int, window: int | None) -> int:
    """Query-key pairs of a causal chunk: query ``n`` (``prefix_len < n <= prefix_len + num_tokens``,
    1-based) sees ``n`` keys, or ``window`` when that is fewer."""
    first, last = prefix_len + 1, prefix_len + num_tokens
    if window is None or last <= window:
        return (first + last) * num_tokens // 2
    if first > window:
        return num_tokens * window
    return (first + window) * (window - first + 1) // 2 + (last - window) * window
