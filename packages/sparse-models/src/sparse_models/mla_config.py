"""Multi-head latent attention's shape, as DeepSeek-V2/V3 and GLM-4.7-Flash (Glm4MoeLite) configs say it.

MLA (DeepSeek-V2, https://arxiv.org/abs/2405.04434) compresses each token's keys and values into a
latent ``c_kv`` of ``kv_lora_rank`` channels (after an RMSNorm) plus one decoupled RoPE key of
``qk_rope_head_dim`` channels shared by all heads. Per head, ``k_nope = W_UK c_kv`` and
``v = W_UV c_kv`` (``kv_b_proj`` stacks both); queries come from ``q_proj`` or, with ``q_lora_rank``,
from ``q_b_proj(norm(q_a_proj(x)))``. The engine caches ``[c_kv | k_rope]`` only and attends in the
absorbed form, so ``ModelConfig`` reports MLA models as one KV head of ``kv_lora_rank +
qk_rope_head_dim`` channels (``cache_dim``).

RoPE layouts: DeepSeek-V2 rotates adjacent channel pairs (complex multiplication); V3 and GLM do the
same when ``rope_interleave`` is set (HF de-interleaves, then rotates halves) and rotate halves
otherwise. Only the dot product of the rotated query and key matters, so interleaved pairs are
de-interleaved for both and rotated as halves (``interleaved``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM")


@dataclass(frozen=True, slots=True)
class MlaConfig:
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    interleaved: bool  # RoPE over adjacent channel pairs (V2 always; V3 / GLM with rope_interleave)
    softmax_scale: float

    @property
    def cache_dim(self) -> int:
        """Channels of one cached row, and of each absorbed query head: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def parse_mla(architecture: str, raw: dict[str, Any]) -> MlaConfig:
    """``MlaConfig`` of an HF ``config.json`` dict of one of ``MLA_ARCHITECTURES``.

    Raises
    ------
    NotImplementedError
        Scaled RoPE (YaRN) or a partial rotary factor, which these models do not use yet here.
    """
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise NotImplementedError(f"{architecture}: rope_type {rope_type!r} is not supported yet (only 'default')")
    if float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))) != 1.0:
        raise NotImplementedError(f"{architecture}: partial_rotary_factor != 1 is not supported")
    nope, rope_dim = int(raw["qk_nope_head_dim"]), int(raw["qk_rope_head_dim"])
    interleaved = True if architecture == "DeepseekV2ForCausalLM" else bool(raw.get("rope_interleave", True))
    return MlaConfig(
        q_lora_rank=raw.get("q_lora_rank"),
        kv_lora_rank=int(raw["kv_lora_rank"]),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=int(raw["v_head_dim"]),
        interleaved=interleaved,
        softmax_scale=(nope + rope_dim) ** -0.5,
    )


def parse_mlp_layer_types(architecture: str, raw: dict[str, Any]) -> tuple[str, ...]:
    """Per layer ``"dense"`` (a SwiGLU MLP) or ``"sparse"`` (routed experts) for the MLA families:
    GLM writes ``mlp_layer_types``; DeepSeek makes the first ``first_k_dense_replace`` layers dense
    (and V2 only where ``n_routed_experts`` is set)."""
    n = raw["num_hidden_layers"]
    if raw.get("mlp_layer_types"):
        return tuple(raw["mlp_layer_types"])
    if architecture == "Glm4MoeLiteForCausalLM":
        return ("dense",) + ("sparse",) * (n - 1)
    first = raw.get("first_k_dense_replace", 0 if architecture == "DeepseekV2ForCausalLM" else 3)
    if raw.get("n_routed_experts") is None:
        return ("dense",) * n
    return tuple("dense" if i < first else "sparse" for i in range(n))
