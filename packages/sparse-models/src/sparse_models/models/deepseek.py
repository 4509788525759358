"""DeepSeek-V2 / V3 and GLM-4.7-Flash (Glm4MoeLite): multi-head latent attention decoders.

DeepSeek-V2 (https://arxiv.org/abs/2405.04434): pre-norm blocks whose attention caches one latent
per token (see ``sparse_models.mla_config``). Attention runs in the absorbed form: each head's
``q_nope`` is projected into latent space through ``W_UK`` (``q_lat = q_nope W_UK``), so that
``q_nope . k_nope = q_lat . c_kv``, and the backend attends ``[q_lat | q_rope]`` against the cached
rows ``[c_kv | k_rope]`` as multi-query attention with values ``c_kv``; ``W_UV`` and ``o_proj`` then
map the latent output back. ``W_UK`` / ``W_UV`` are views of ``kv_b_proj``'s weight ``[H * (nope +
v), kv_lora_rank]``, loaded as the checkpoint stores it. Under tensor parallelism each rank runs its
share of the heads: q (or q_b), kv_b (its heads' ``W_UK`` / ``W_UV`` rows) column-parallel, o
row-parallel; the latent projections are replicated, so every rank caches the whole latent. V3 and
GLM differ from V2 only in the RoPE layout flag and in their routers (``deepseek_moe.py``;
``mlp_layer_types``: which layers are MoE).
"""

from __future__ import annotations

import torch
from torch import nn

from sparse_models.attention import AttentionBackend
from sparse_models.config import ModelConfig
from sparse_models.distributed import shard
from sparse_models.layers import Linear, LMHead, RMSNorm, RotaryEmbedding, VocabEmbedding
from sparse_models.layers.moe import route_expert_weight
from sparse_models.layers.parallel_linear import RowParallelLinear, column_parallel_linear
from sparse_models.models.deepseek_moe import DeepseekMoe
from sparse_models.models.llama import MLP, DecoderLayer
from sparse_models.registry import register_model

_LORA_NORM_EPS = 1e-6  # HF builds q_a_layernorm / kv_a_layernorm with the default eps, not rms_norm_eps


class MlaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        mla = config.mla
        self.layer_idx = layer_idx
        self.mla = mla
        heads = config.num_attention_heads
        self.num_heads = shard(heads, "num_attention_heads")[1]  # this rank's heads (all on one rank)
        qk_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        bias = config.attention_bias
        # Per-head projections are column-parallel (their rows are head-major), the latent ones replicated.
        if mla.q_lora_rank is None:
            self.q_proj = column_parallel_linear(config.hidden_size, heads * qk_dim)
        else:
            self.q_a_proj = Linear(config.hidden_size, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, _LORA_NORM_EPS)
            self.q_b_proj = column_parallel_linear(mla.q_lora_rank, heads * qk_dim)
        self.kv_a_proj_with_mqa = Linear(config.hidden_size, mla.cache_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, _LORA_NORM_EPS)
        self.kv_b_proj = column_parallel_linear(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim))
        self.o_proj = RowParallelLinear(heads * mla.v_head_dim, config.hidden_size, bias=bias)

    def _absorb_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_UK [H, nope, kv_lora_rank]`` and ``W_UV [H, v, kv_lora_rank]``: views, no copies."""
        mla = self.mla
        w = self.kv_b_proj.weight.view(self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        return w[:, : mla.qk_nope_head_dim], w[:, mla.qk_nope_head_dim :]

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(x) if self.mla.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(x.shape[0], self.num_heads, -1)  # [T, H, nope + rope]

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, attn: AttentionBackend
    ) -> torch.Tensor:
        mla = self.mla
        q_nope, q_rope = self._queries(x).split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)  # [T, kv_lora_rank]
        q_rope, k_rope = _layout(q_rope, mla.interleaved), _layout(k_rope[:, None, :], mla.interleaved)
        q_rope, k_rope = rotary(positions, q_rope, k_rope)  # [T, H, rope], [T, 1, rope]
        w_uk, w_uv = self._absorb_weights()
        q_lat = torch.einsum("thn,hnc->thc", q_nope, w_uk)  # [T, H, kv_lora_rank]
        q = torch.cat([q_lat, q_rope], dim=-1)  # [T, H, cache_dim]
        kv = torch.cat([latent[:, None, :], k_rope.to(latent.dtype)], dim=-1)  # [T, 1, cache_dim]
        o_lat = attn.forward(self.layer_idx, q, kv, kv[..., : mla.kv_lora_rank], mla.softmax_scale)
        o = torch.einsum("thc,hvc->thv", o_lat, w_uv)  # [T, H, v]
        return self.o_proj(o.reshape(x.shape[0], self.num_heads * mla.v_head_dim))


def _layout(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Adjacent channel pairs ``(2i, 2i + 1)`` -> halves ``(i, i + D/2)``, so that rotating halves rotates
    the pairs; applied to both q and k, it leaves their dot product unchanged. Contiguous either way."""
    if not interleaved:
        return x.contiguous()
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2).contiguous()


def _mlp(config: ModelConfig, layer_idx: int) -> nn.Module:
    return MLP(config) if config.mlp_layer_types[layer_idx] == "dense" else DeepseekMoe(config)


class MlaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        mla = config.mla
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(mla.qk_rope_head_dim, config.max_position_embeddings, config.rope_theta)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, _mlp(config, i), MlaAttention(config, i)) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None  # [T, hidden]
        for layer in self.layers:
            x, residual = layer(x, residual, positions, self.rotary_emb, attn)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]


@register_model("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM")
class DeepseekForCausalLM(nn.Module):
    """A causal LM with MLA attention over a flat varlen batch; parameter names follow HF checkpoints.

    ``forward`` / ``compute_logits`` as ``LlamaForCausalLM``. The attention backend receives queries
    ``[T, H, cache_dim]``, the rows to cache ``[T, 1, cache_dim]`` as keys and their first
    ``kv_lora_rank`` channels as values, and returns ``[T, H, kv_lora_rank]``. Per-expert checkpoint
    tensors are stacked into each routed layer's ``FusedExperts`` at load.
    """

    packed_modules_mapping = {"gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}
    skip_checkpoint_suffixes = ("rotary_emb.inv_freq",)

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = MlaModel(config)
        self.lm_head = LMHead(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @staticmethod
    def route_checkpoint_name(name: str) -> tuple[str, tuple[int, str]] | None:
        return route_expert_weight(name)
