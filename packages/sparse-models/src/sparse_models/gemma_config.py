"""What Gemma 3 text models add to a Llama-shaped config.

Gemma 3 (Gemma Team 2025, https://arxiv.org/abs/2503.19786) interleaves local layers (a sliding
window, RoPE base 10K) with global ones (full attention, RoPE base 1M), five to one by default. Its
softmax scale is ``query_pre_attn_scalar ** -0.5`` rather than ``head_dim ** -0.5``, its MLP is a
tanh-GELU gate, the embedding is scaled by ``sqrt(hidden_size)``, and its final logits may be
soft-capped. transformers 5 writes RoPE as ``rope_parameters`` per layer type; older files write
``rope_theta`` (global) and ``rope_local_base_freq`` (local) at the top level.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GEMMA_ARCHITECTURES = ("Gemma3ForCausalLM",)
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


@dataclass(frozen=True, slots=True)
class GemmaConfig:
    query_pre_attn_scalar: float  # softmax scale is its inverse square root
    local_rope_theta: float  # RoPE base of the sliding-window layers
    final_logit_softcapping: float | None  # logits -> cap * tanh(logits / cap) when set

    @property
    def softmax_scale(self) -> float:
        return self.query_pre_attn_scalar**-0.5


def gemma_rope(raw: dict[str, Any], layer_type: str) -> dict[str, Any]:
    """The RoPE settings of one layer type, as a plain config dict ``_parse_rope`` reads."""
    params = raw.get("rope_parameters")
    if params is not None and layer_type in params:  # transformers >= 5
        return {"rope_parameters": params[layer_type]}
    if layer_type == "sliding_attention":
        return {"rope_theta": raw.get("rope_local_base_freq", 10_000.0)}
    return {"rope_theta": raw.get("rope_theta", 1_000_000.0), "rope_scaling": raw.get("rope_scaling")}


def gemma_layer_types(raw: dict[str, Any]) -> tuple[str, ...]:
    """Per layer ``sliding_attention`` or ``full_attention``: ``layer_types`` when written, else every
    ``sliding_window_pattern``-th layer (default 6) is global, HF's rule."""
    if raw.get("layer_types"):
        return tuple(raw["layer_types"])
    pattern = raw.get("sliding_window_pattern", 6)
    return tuple(
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(raw["num_hidden_layers"])
    )


def parse_gemma(raw: dict[str, Any], local_rope_theta: float) -> GemmaConfig:
    """``GemmaConfig`` of a Gemma 3 text ``config.json`` dict (defaults are Gemma3TextConfig's).

    Raises
    ------
    NotImplementedError
        Attention logit soft-capping, bidirectional attention, or an MLP activation other than tanh GELU.
    """
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _GELU_TANH:
        raise NotImplementedError(f"Gemma 3 with hidden_activation={act!r} is not supported (only tanh GELU)")
    if raw.get("attn_logit_softcapping") is not None:
        raise NotImplementedError("attention logit soft-capping (attn_logit_softcapping) is not supported")
    if raw.get("use_bidirectional_attention"):
        raise NotImplementedError("bidirectional attention (use_bidirectional_attention) is not supported")
    cap = raw.get("final_logit_softcapping")
    return GemmaConfig(
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
        local_rope_theta=local_rope_theta,
        final_logit_softcapping=None if cap is None else float(cap),
    )
