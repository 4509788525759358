"""Logits equal HF transformers' on tiny random checkpoints of every family (fp32)."""

from __future__ import annotations

import pytest
import torch

from sparse_models import load_model

ATOL = 1e-4


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_logits_match_hf(family, hf_checkpoint, random_batch, our_logits, hf_logits):
    hf_model, path = hf_checkpoint(family)
    model, config = load_model(path)
    seqs = random_batch(config.vocab_size)
    ours = our_logits(model, seqs, sliding_window=config.layer_sliding_windows)
    torch.testing.assert_close(ours, hf_logits(hf_model, seqs), atol=ATOL, rtol=0)


def test_mistral_window_matters(hf_checkpoint, random_batch, our_logits, hf_logits):
    """Guards the parity test above: with the window ignored, the long sequence diverges."""
    hf_model, path = hf_checkpoint("mistral")
    model, config = load_model(path)
    assert config.sliding_window == 8
    seqs = random_batch(config.vocab_size)
    full = our_logits(model, seqs, sliding_window=None)
    assert not torch.allclose(full, hf_logits(hf_model, seqs), atol=ATOL, rtol=0)


def test_sharded_checkpoint(hf_checkpoint, random_batch, our_logits, hf_logits):
    hf_model, path = hf_checkpoint("qwen2", max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 1
    model, config = load_model(path)
    seqs = random_batch(config.vocab_size)
    torch.testing.assert_close(our_logits(model, seqs), hf_logits(hf_model, seqs), atol=ATOL, rtol=0)


@pytest.mark.parametrize("tie", [True, False])
def test_tied_and_untied_embeddings(tie, hf_checkpoint, random_batch, our_logits, hf_logits):
    hf_model, path = hf_checkpoint("qwen3", tie_word_embeddings=tie)
    model, config = load_model(path)
    assert config.tie_word_embeddings is tie
    shared = model.lm_head.weight is model.model.embed_tokens.weight
    assert shared is tie
    seqs = random_batch(config.vocab_size)
    torch.testing.assert_close(our_logits(model, seqs), hf_logits(hf_model, seqs), atol=ATOL, rtol=0)


def test_bf16_close_to_hf(hf_checkpoint, random_batch, our_logits, hf_logits):
    """Same op order as HF, so bf16 stays close too (looser: attention kernels differ)."""
    hf_model, path = hf_checkpoint("llama")
    model, config = load_model(path, dtype=torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16
    seqs = random_batch(config.vocab_size)
    ours = our_logits(model, seqs)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, hf_logits(hf_model.to(torch.bfloat16), seqs), atol=5e-2, rtol=0)
