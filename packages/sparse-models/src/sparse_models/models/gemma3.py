"""Gemma 3 text models (Gemma Team 2025, https://arxiv.org/abs/2503.19786).

Llama's attention (GQA with q/k RMS norms before RoPE) with Gemma's numerics: local layers slide a
window over the KV (the attention backend applies it, as for Mistral) and rotate with their own RoPE
base, the softmax scale is ``query_pre_attn_scalar ** -0.5``, every sub-block is sandwiched between
two norms (pre and post), RMSNorm multiplies by ``1 + weight``, the MLP gates with tanh GELU, the
embedding is scaled by ``sqrt(hidden_size)`` and the final logits may be soft-capped.

As in ``llama.py``, each layer hands its last output and the residual stream apart to the next
layer's first norm, which adds them (one fused add+norm on CUDA).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparse_models.attention import AttentionBackend
from sparse_models.config import ModelConfig
from sparse_models.layers import LMHead, RMSNorm, RotaryEmbedding, VocabEmbedding
from sparse_models.layers.parallel_linear import MergedColumnParallelLinear, RowParallelLinear
from sparse_models.models.llama import Attention, LlamaForCausalLM
from sparse_models.registry import register_model
from sparse_models.weights import copy_checked


class GemmaRMSNorm(RMSNorm):
    """RMSNorm whose checkpoint stores ``weight - 1``: the loader adds the one back (in fp32), so the
    forward is plain ``RMSNorm``'s, fused kernels included. In bf16 the stored ``1 + w`` is rounded
    once, where HF keeps ``w`` in bf16 and adds 1 in fp32 at every call (fp32 is exact either way)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__(dim, eps)
        self.weight.weight_loader = _load_plus_one


def _load_plus_one(param: nn.Parameter, loaded: torch.Tensor) -> None:
    copy_checked(param.data, loaded.float() + 1.0)


class GeluTanhAndMul(nn.Module):
    """``gelu_tanh(gate) * up`` for ``x = [gate | up]`` on the last dim: [..., 2I] -> [..., I]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class GemmaMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear.even(config.hidden_size, {"gate": size, "up": size})
        self.act = GeluTanhAndMul()
        self.down_proj = RowParallelLinear(size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class GemmaAttention(Attention):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.scale = config.softmax_scale
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = GemmaAttention(config, layer_idx)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = GemmaMLP(config)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        attn: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp_out, h)``: this layer's output is ``h + mlp_out`` (see ``llama.DecoderLayer``)."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(x, positions, rotary, attn))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.hidden_size**0.5
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.rotary_emb_local = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.gemma.local_rope_theta
        )
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.local = tuple(t == "sliding_attention" for t in config.layer_types)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        x, residual = x * torch.tensor(self.embed_scale, dtype=x.dtype), None  # HF rounds the scale to x's dtype
        for layer, local in zip(self.layers, self.local, strict=True):
            rotary = self.rotary_emb_local if local else self.rotary_emb
            x, residual = layer(x, residual, positions, rotary, attn)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]


@register_model("Gemma3ForCausalLM")
class Gemma3ForCausalLM(nn.Module):
    """Gemma 3's text decoder over a flat varlen batch; parameter names follow HF checkpoints."""

    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping
    skip_checkpoint_suffixes = LlamaForCausalLM.skip_checkpoint_suffixes

    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.gemma is None:
            raise ValueError(f"{config.architecture} is not a Gemma 3 config")
        self.config = config
        self.model = Gemma3Model(config)
        self.lm_head = LMHead(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.softcap = config.gemma.final_logit_softcapping

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """``[T] ids, [T] positions -> [T, hidden_size]`` final-normed hidden states (see ``LlamaForCausalLM``)."""
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, hidden_size] -> [N, vocab_size]`` fp32, soft-capped when the config says so."""
        logits = self.lm_head(hidden)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
