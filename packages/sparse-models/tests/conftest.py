"""Tiny random HF checkpoints of each family, and runners that compare our logits with HF's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from sparse_models import ContiguousCausalAttention

BASE = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    attn_implementation="eager",
)

FAMILIES = {
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            num_hidden_layers=3,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                # Small enough that all three frequency bands (kept, blended, scaled) occur at head_dim 16.
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    # Layers 0 and 2 routed (8 experts, 3 per token), layer 1 dense via mlp_only_layers.
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            initializer_range=0.1,
        ),
    ),
}

# Lengths chosen so Mistral's window (8) is exceeded and the batch is ragged.
SEQ_LENS = (5, 13, 1)


def make_hf_model(family: str, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**BASE, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    # HF zero-initialises biases and sets norms to 1; randomise them so a wrong route would show.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return model


@pytest.fixture
def hf_checkpoint(tmp_path: Path):
    """``hf_checkpoint(family, **config_overrides) -> (hf_model, path)``."""

    def build(family: str, *, max_shard_size: str | None = None, **overrides):
        model = make_hf_model(family, **overrides)
        kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(tmp_path, **kwargs)
        return model, tmp_path

    return build


@pytest.fixture
def random_batch():
    """``random_batch(vocab_size, seq_lens=SEQ_LENS, seed=0) -> list of [L] int64``."""
    return _random_batch


@pytest.fixture
def our_logits():
    """``our_logits(model, seqs, sliding_window=None) -> [sum(L), vocab]``, one flat varlen batch."""
    return _our_logits


@pytest.fixture
def hf_logits():
    """``hf_logits(hf_model, seqs) -> [sum(L), vocab]``, HF run one sequence at a time."""
    return _hf_logits


def _random_batch(vocab_size: int, seq_lens=SEQ_LENS, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen) for n in seq_lens]


@torch.inference_mode()
def _our_logits(model, seqs: list[torch.Tensor], sliding_window=None) -> torch.Tensor:
    """Run all sequences as one flat varlen batch: [sum(L), vocab]."""
    input_ids = torch.cat(seqs)
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    cu_seqlens = torch.tensor([0, *torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()])
    attn = ContiguousCausalAttention(cu_seqlens, sliding_window=sliding_window)
    return model.compute_logits(model(input_ids, positions, attn))


@torch.inference_mode()
def _hf_logits(hf_model, seqs: list[torch.Tensor]) -> torch.Tensor:
    """HF, one sequence at a time (no padding involved): [sum(L), vocab]."""
    return torch.cat([hf_model(s[None]).logits[0].float() for s in seqs])
