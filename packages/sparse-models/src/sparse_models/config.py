"""The model's shape and numerics, parsed once from an HF ``config.json``.

HF spreads what a family means over three places: ``config.json``, the family's config class
(defaults for absent keys) and the family's model code (choices it makes regardless of the config,
such as Qwen2's q/k/v bias). ``_FAMILIES`` records the last two so that ``ModelConfig`` alone says
everything the model code needs.

RoPE settings come in two layouts: transformers < 5 writes ``rope_theta`` and ``rope_scaling``
at the top level; transformers 5 writes one ``rope_parameters`` dict holding ``rope_type``,
``rope_theta`` and the scaling keys. Both parse to the same ``ModelConfig``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sparse_models.gemma_config import GEMMA_ARCHITECTURES, GemmaConfig, gemma_layer_types, gemma_rope, parse_gemma
from sparse_models.mla_config import MLA_ARCHITECTURES, MlaConfig, parse_mla, parse_mlp_layer_types
from sparse_models.moe_config import QWEN_MOE_ARCHITECTURES, MoeConfig, parse_deepseek_moe, parse_qwen_moe
from sparse_models.registry import UnsupportedArchitectureError, is_registered, supported_architectures


@dataclass(frozen=True, slots=True)
class _Family:
    """What a family's HF config class and model code assume beyond ``config.json``."""

    qkv_bias: bool | None = None  # None: read ``attention_bias``; a bool: fixed by the model code
    out_bias_follows_qkv: bool = True  # Llama/Qwen3 put ``attention_bias`` on o_proj too; Qwen2 does not
    qk_norm: bool = False
    default_head_dim: int | None = None  # None: hidden_size // num_attention_heads
    sliding: str = "none"  # "none" | "all" (Mistral) | "qwen" (use_sliding_window + max_window_layers) | "gemma"


_FAMILIES: dict[str, _Family] = {
    "LlamaForCausalLM": _Family(),
    "MistralForCausalLM": _Family(sliding="all"),
    "Qwen2ForCausalLM": _Family(qkv_bias=True, out_bias_follows_qkv=False, sliding="qwen"),
    "Qwen3ForCausalLM": _Family(qk_norm=True, default_head_dim=128, sliding="qwen"),
    "Qwen3MoeForCausalLM": _Family(qk_norm=True, sliding="qwen"),  # HF 5: head_dim defaults to hidden / heads
    **{arch: _Family() for arch in MLA_ARCHITECTURES},
    **{arch: _Family(qk_norm=True, default_head_dim=256, sliding="gemma") for arch in GEMMA_ARCHITECTURES},
}


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama-3 frequency scaling (the only scaled RoPE supported).

    See ``sparse_models.layers.rotary.llama3_inv_freq`` for what each field does.
    """

    rope_type: str
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Everything the decoder needs, independent of transformers.

    ``layer_types`` has one entry per layer, ``"full_attention"`` or ``"sliding_attention"``;
    ``layer_sliding_windows`` turns it into the window each layer's attention must apply. Model code
    does not mask: the attention backend does, so it is handed these windows by whoever builds it.

    ``mla``: multi-head latent attention's shape (DeepSeek-V2/V3, GLM-4.7-Flash), None for GQA models.
    An MLA model's ``num_key_value_heads`` and ``head_dim`` are its attention as the KV cache sees it:
    one head of ``mla.cache_dim`` channels. ``mlp_layer_types``: per layer ``"dense"`` or ``"sparse"``
    (routed experts). ``moe``: the routed experts' shape (``sparse_models.moe_config``), None without.
    ``gemma``: what Gemma 3 adds (``sparse_models.gemma_config``), None for other families.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections
    attention_out_bias: bool  # bias on o_proj
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    layer_types: tuple[str, ...]
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # HF allows an int or a list; always a tuple here
    torch_dtype: torch.dtype | None
    mla: MlaConfig | None = None
    mlp_layer_types: tuple[str, ...] = ()
    moe: MoeConfig | None = None
    gemma: GemmaConfig | None = None

    @property
    def softmax_scale(self) -> float:
        """The attention's softmax scale (``head_dim ** -0.5`` unless the family says otherwise)."""
        if self.mla is not None:
            return self.mla.softmax_scale
        if self.gemma is not None:
            return self.gemma.softmax_scale
        return self.head_dim**-0.5

    @property
    def layer_sliding_windows(self) -> tuple[int | None, ...]:
        """Per layer: the number of most recent tokens a query may see (itself included), or None."""
        return tuple(self.sliding_window if t == "sliding_attention" else None for t in self.layer_types)

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Parse an HF ``config.json`` dict.

        Raises
        ------
        UnsupportedArchitectureError
            The architecture is neither a known family nor registered.
        NotImplementedError
            A RoPE type or activation this package does not implement.
        """
        architecture = _architecture(raw)
        family = _FAMILIES.get(architecture, _Family())
        hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
        attention_bias = family.qkv_bias if family.qkv_bias is not None else bool(raw.get("attention_bias", False))
        gemma = None
        if architecture in GEMMA_ARCHITECTURES:  # RoPE per layer type; the MLP's activation is checked there
            rope_theta, rope_scaling = _parse_rope(gemma_rope(raw, "full_attention"))
            local_theta, local_scaling = _parse_rope(gemma_rope(raw, "sliding_attention"))
            if local_scaling is not None:
                raise NotImplementedError("scaled RoPE on Gemma's sliding-window layers is not supported")
            gemma = parse_gemma(raw, local_theta)
        else:
            act = raw.get("hidden_act", "silu")
            if act != "silu":
                raise NotImplementedError(f"hidden_act={act!r} is not supported (only 'silu')")
            rope_theta, rope_scaling = _parse_rope(raw)
        num_layers = raw["num_hidden_layers"]
        sliding_window, layer_types = _parse_sliding(raw, family, num_layers)
        mla = parse_mla(architecture, raw) if architecture in MLA_ARCHITECTURES else None
        mlp_layer_types = parse_mlp_layer_types(architecture, raw) if mla else ("dense",) * num_layers
        moe = parse_deepseek_moe(architecture, raw) if mla and "sparse" in mlp_layer_types else None
        if architecture in QWEN_MOE_ARCHITECTURES:
            moe, mlp_layer_types = parse_qwen_moe(raw)
        return cls(
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=1 if mla else raw.get("num_key_value_heads") or heads,
            head_dim=mla.cache_dim if mla else raw.get("head_dim") or family.default_head_dim or hidden // heads,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma is not None)),  # Gemma ties by default
            attention_bias=attention_bias,
            attention_out_bias=attention_bias if family.out_bias_follows_qkv else False,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=family.qk_norm,
            sliding_window=sliding_window,
            layer_types=layer_types,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_token_ids(raw.get("eos_token_id")),
            torch_dtype=_dtype(raw.get("dtype") or raw.get("torch_dtype")),  # transformers 5 renamed the key
            mla=mla,
            mlp_layer_types=mlp_layer_types,
            moe=moe,
            gemma=gemma,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Parse ``<path>/config.json`` (``path`` may also be the file itself)."""
        path = Path(path)
        file = path if path.is_file() else path / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"no config.json at {path}")
        return cls.from_hf_dict(json.loads(file.read_text()))


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else None
    if arch is None or (arch not in _FAMILIES and not is_registered(arch)):
        supported = sorted(set(_FAMILIES) | set(supported_architectures()))
        raise UnsupportedArchitectureError(
            f"unsupported architecture {arch!r} (config 'architectures'={archs}); supported: {supported}"
        )
    return arch


def _parse_rope(raw: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """Read either RoPE layout into ``(theta, scaling)``."""
    params = raw.get("rope_parameters")
    if params is not None:  # transformers >= 5: everything in one dict
        if "rope_theta" not in params and "rope_type" not in params:
            raise NotImplementedError(f"per-layer-type rope_parameters are not supported: {params}")
        theta, scaling = params.get("rope_theta", raw.get("rope_theta", 10000.0)), params
    else:  # transformers < 5: theta at top level, optional scaling dict
        theta, scaling = raw.get("rope_theta", 10000.0), raw.get("rope_scaling")
    scaling = scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise NotImplementedError(f"rope_type {rope_type!r} is not supported (supported: 'default', 'llama3')")
    return float(theta), RopeScaling(
        rope_type=rope_type,
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


def _parse_sliding(raw: dict[str, Any], family: _Family, num_layers: int) -> tuple[int | None, tuple[str, ...]]:
    window = raw.get("sliding_window")
    if family.sliding == "gemma":
        return raw.get("sliding_window", 4096), gemma_layer_types(raw)
    if family.sliding == "qwen" and not raw.get("use_sliding_window", False):
        window = None
    if window is None or family.sliding == "none":
        return None, ("full_attention",) * num_layers
    if raw.get("layer_types"):  # transformers 5 writes the per-layer choice out
        return window, tuple(raw["layer_types"])
    if family.sliding == "qwen":  # only layers from max_window_layers on slide
        first = raw.get("max_window_layers", num_layers)
        return window, tuple("sliding_attention" if i >= first else "full_attention" for i in range(num_layers))
    return window, ("sliding_attention",) * num_layers


def _token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list | tuple) else (int(value),)


def _dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in config.json")
    return dtype


def read_model_config(path: str | Path) -> ModelConfig:
    """``ModelConfig`` of the checkpoint directory ``path`` (reads only its config.json)."""
    return ModelConfig.from_pretrained(path)
