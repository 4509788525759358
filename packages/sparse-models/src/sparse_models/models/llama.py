"""The Llama decoder, and the families that are Llama up to a config switch.

Llama (Touvron et al. 2023, https://arxiv.org/abs/2302.13971): pre-norm residual blocks of
grouped-query attention with RoPE and a SwiGLU MLP. The others differ only in what ``ModelConfig``
already says: Qwen2 adds a bias to q/k/v, Qwen3 RMS-normalises each q and k head before RoPE,
Mistral slides a window over the KV (which the attention backend applies, not this code).

Tensors are a flat varlen batch: the tokens of all sequences concatenated, ``T`` in total; which
token belongs to which sequence is the attention backend's business alone.

Under tensor parallelism (``sparse_models.distributed``) each rank runs its share of the heads and of
the MLP's width: q/k/v and gate/up are column-parallel, o and down row-parallel (one all-reduce each).

Each decoder layer returns its MLP output and the residual stream apart; the next layer's first norm
adds them (vLLM's ``RMSNorm(x, residual)``), so on CUDA every residual add rides in a fused add+norm
kernel, and q/k norm + RoPE, SiLU*mul are one kernel each. On CPU the same calls run HF's ops.

Decode batches on the Triton kernels (``linear_epilogue.fuses``: CUDA, at most 16 rows, one rank, every
layer this file's attention and dense MLP) go further: o and down add the residual and prepare the next
norm in their epilogues, qkv and gate/up apply that norm's row scale in theirs, and gate/up writes
``silu(gate) * up``, so a layer is its four projections plus attention, with no norm or SiLU launch
between them (``DecoderLayer.decode_fused``). Outputs agree with the unfused path within bf16 rounding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from sparse_kernels.linear_epilogue import NormedHidden, add_norm_inputs, fuses, linear_add_norm, linear_normed
from sparse_models.attention import AttentionBackend
from sparse_models.config import ModelConfig
from sparse_models.distributed import tp_world_size
from sparse_models.layers import LMHead, RMSNorm, RotaryEmbedding, SiluAndMul, VocabEmbedding
from sparse_models.layers.parallel_linear import MergedColumnParallelLinear, RowParallelLinear, qkv_parallel_linear
from sparse_models.registry import register_model


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        num_heads, num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.qkv_proj = qkv_parallel_linear(
            config.hidden_size, self.head_dim, num_heads, num_kv_heads, config.attention_bias
        )
        # This rank's heads (all of them on one rank).
        self.num_heads = self.qkv_proj.shard_sizes["q"] // self.head_dim
        self.num_kv_heads = self.qkv_proj.shard_sizes["k"] // self.head_dim
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, config.hidden_size, bias=config.attention_out_bias)
        self.q_norm = self.k_norm = None
        if config.qk_norm:  # Qwen3: per head, over head_dim, before RoPE
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, attn: AttentionBackend
    ) -> torch.Tensor:
        return self.o_proj(self.attend(self.qkv_proj(x), positions, rotary, attn))

    def attend(
        self, qkv: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, attn: AttentionBackend
    ) -> torch.Tensor:
        """The merged q/k/v projection's output -> attention output ``[T, Hq * D]``, before ``o_proj``."""
        # Views of the merged projection, no copies: the RoPE kernel and the KV store read strided rows.
        q, k, v = self.qkv_proj.split(qkv)
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        # Rotated by the backend (with its KV store where it can); Qwen3 norms each head first.
        rotation = rotary.rotation(positions, self.q_norm, self.k_norm)
        o = attn.forward(self.layer_idx, q, k, v, self.scale, rotation)  # [T, Hq, D]
        return o.reshape(-1, self.num_heads * self.head_dim)  # a view of the kernels' output


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``, gate and up as one matmul."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear.even(
            config.hidden_size, {"gate": size, "up": size}, bias=config.mlp_bias
        )
        self.act = SiluAndMul()
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """``attention``: the block's attention module (another family's, e.g. MLA); default GQA ``Attention``."""

    def __init__(self, config: ModelConfig, layer_idx: int, mlp: nn.Module, attention: nn.Module | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx) if attention is None else attention
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        attn: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp_out, h)``: this layer's output is ``h + mlp_out``, left for the next norm to add.

        ``x`` is the previous layer's MLP output and ``residual`` its residual stream (None for the
        first layer, whose ``x`` is the embedding).
        """
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, rotary, attn)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def decode_fused(
        self,
        h: NormedHidden,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        attn: AttentionBackend,
        next_norm: RMSNorm,
    ) -> NormedHidden:
        """The layer on ``linear_epilogue``'s kernels: ``h`` carries this layer's input norm pending, the
        result the next norm's (``next_norm``: the next layer's input norm, or the model's final norm).
        The residual stream is updated in place (``h.hidden``)."""
        a, mlp = self.self_attn, self.mlp
        o = a.attend(linear_normed(h, a.qkv_proj.weight, a.qkv_proj.bias), positions, rotary, attn)
        post = self.post_attention_layernorm
        h = linear_add_norm(o, a.o_proj.weight, a.o_proj.bias, h.hidden, post.weight, post.eps)
        act = linear_normed(h, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, gated=True)
        return linear_add_norm(act, mlp.down_proj.weight, mlp.down_proj.bias, h.hidden, next_norm.weight, next_norm.eps)

    def fusable(self) -> bool:
        """Whether ``decode_fused`` computes this layer: GQA attention and the dense SwiGLU MLP of this
        file, plain RMSNorms (subclasses with other norms or blocks are not)."""
        norms = (self.input_layernorm, self.post_attention_layernorm)
        return type(self.self_attn) is Attention and type(self.mlp) is MLP and all(type(n) is RMSNorm for n in norms)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, make_mlp: Callable[[ModelConfig, int], nn.Module]):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, make_mlp(config, i)) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self._fusable = all(layer.fusable() for layer in self.layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None  # [T, hidden]
        if self._fusable and tp_world_size() == 1 and fuses(x):
            return self._decode_fused(x, positions, attn)
        for layer in self.layers:
            x, residual = layer(x, residual, positions, self.rotary_emb, attn)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]

    def _decode_fused(self, x: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        first = self.layers[0].input_layernorm
        h = add_norm_inputs(x, first.weight, first.eps)  # the embedding: no projection wrote it
        for i, layer in enumerate(self.layers):
            nxt = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            h = layer.decode_fused(h, positions, self.rotary_emb, attn, nxt)
        return self.norm(h.hidden)  # one launch; the last scaled copy and sums go unused


@register_model("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
class LlamaForCausalLM(nn.Module):
    """A causal LM over a flat varlen batch; parameter names follow HF checkpoints.

    Class attributes read by the loader: ``packed_modules_mapping`` (checkpoint module ->
    ``(merged module, shard id)``) and ``skip_checkpoint_suffixes`` (non-parameters some
    checkpoints carry). A family that is this decoder with another MLP on some layers (Qwen3-MoE's
    routed experts) subclasses it and overrides ``make_mlp``.
    """

    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }
    skip_checkpoint_suffixes = ("rotary_emb.inv_freq",)

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.make_mlp)
        self.lm_head = LMHead(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def make_mlp(config: ModelConfig, layer_idx: int) -> nn.Module:
        """The feed-forward block of layer ``layer_idx``: the dense SwiGLU MLP."""
        return MLP(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """Final-normed hidden states of every token.

        Parameters
        ----------
        input_ids : [T] int64, the tokens of all sequences concatenated.
        positions : [T] int64, each token's position within its own sequence.
        attn : the backend that stores K/V and attends; it knows the sequence boundaries.

        Returns
        -------
        [T, hidden_size] in the model's dtype.
        """
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, hidden_size] -> [N, vocab_size]`` fp32 (pass only the rows you sample from)."""
        return self.lm_head(hidden)
