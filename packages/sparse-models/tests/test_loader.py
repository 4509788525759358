"""load_model: fused checkpoints, dummy weights, dtypes, and each clear error."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from sparse_models import CheckpointError, UnsupportedArchitectureError, load_model

CKPT = "model.safetensors"


def _rewrite(path, edit) -> None:
    """Apply ``edit(tensors) -> tensors`` to the checkpoint's single safetensors file."""
    tensors = load_file(path / CKPT)
    save_file(edit(dict(tensors)), path / CKPT, metadata={"format": "pt"})


def _fuse(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Store q/k/v and gate/up already concatenated, as some exporters do."""
    for name in [n for n in tensors if ".q_proj." in n]:
        parts = [tensors.pop(name.replace("q_proj", p)) for p in ("q_proj", "k_proj", "v_proj")]
        tensors[name.replace("q_proj", "qkv_proj")] = torch.cat(parts)
    for name in [n for n in tensors if ".gate_proj." in n]:
        parts = [tensors.pop(name.replace("gate_proj", p)) for p in ("gate_proj", "up_proj")]
        tensors[name.replace("gate_proj", "gate_up_proj")] = torch.cat(parts)
    return tensors


def test_fused_checkpoint_loads_same_logits(hf_checkpoint, random_batch, our_logits, hf_logits):
    hf_model, path = hf_checkpoint("qwen2")  # has q/k/v biases, so fused biases are exercised too
    _rewrite(path, _fuse)
    assert any("qkv_proj.bias" in n for n in load_file(path / CKPT))
    model, config = load_model(path)
    seqs = random_batch(config.vocab_size)
    torch.testing.assert_close(our_logits(model, seqs), hf_logits(hf_model, seqs), atol=1e-4, rtol=0)


def test_rotary_inv_freq_is_skipped(hf_checkpoint):
    _, path = hf_checkpoint("llama")
    _rewrite(path, lambda t: t | {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)})
    load_model(path)


def test_tied_checkpoint_with_redundant_lm_head(hf_checkpoint):
    """Some tied checkpoints still store lm_head.weight; it must not overwrite the embedding."""
    _, path = hf_checkpoint("qwen3", tie_word_embeddings=True)
    _rewrite(path, lambda t: t | {"lm_head.weight": torch.zeros_like(t["model.embed_tokens.weight"])})
    model, _ = load_model(path)
    assert model.lm_head.weight.abs().sum() > 0


def test_missing_tensor(hf_checkpoint):
    _, path = hf_checkpoint("llama")
    _rewrite(path, lambda t: {n: v for n, v in t.items() if n != "model.layers.1.self_attn.k_proj.weight"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(path)


def test_missing_plain_tensor(hf_checkpoint):
    _, path = hf_checkpoint("qwen3")
    _rewrite(path, lambda t: {n: v for n, v in t.items() if n != "model.layers.0.self_attn.q_norm.weight"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.q_norm\.weight"):
        load_model(path)


def test_untied_without_lm_head(hf_checkpoint):
    _, path = hf_checkpoint("mistral", tie_word_embeddings=False)
    _rewrite(path, lambda t: {n: v for n, v in t.items() if n != "lm_head.weight"})
    with pytest.raises(CheckpointError, match=r"lm_head\.weight"):
        load_model(path)


def test_unexpected_tensor(hf_checkpoint):
    _, path = hf_checkpoint("llama")
    _rewrite(path, lambda t: t | {"model.layers.0.self_attn.extra.weight": torch.zeros(3)})
    with pytest.raises(CheckpointError, match=r"unexpected.*model\.layers\.0\.self_attn\.extra\.weight"):
        load_model(path)


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.v_proj.weight", "model.norm.weight"])
def test_shape_mismatch(hf_checkpoint, name):
    _, path = hf_checkpoint("llama")
    _rewrite(path, lambda t: t | {name: torch.zeros(t[name].shape[0] + 1, *t[name].shape[1:])})
    with pytest.raises(CheckpointError, match=re.escape(name) + ".*shape mismatch"):
        load_model(path)


def test_no_weight_files(hf_checkpoint):
    _, path = hf_checkpoint("llama")
    (path / CKPT).unlink()
    with pytest.raises(CheckpointError, match="no safetensors"):
        load_model(path)


def test_index_names_absent_shard(hf_checkpoint):
    _, path = hf_checkpoint("llama", max_shard_size="40KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    (path / sorted(set(index["weight_map"].values()))[-1]).unlink()
    with pytest.raises(CheckpointError, match="do not exist"):
        load_model(path)


def test_unsupported_architecture(hf_checkpoint):
    _, path = hf_checkpoint("llama")
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(raw | {"architectures": ["FalconForCausalLM"]}))
    with pytest.raises(UnsupportedArchitectureError, match="FalconForCausalLM.*LlamaForCausalLM"):
        load_model(path)


def test_dtype_default_and_explicit(hf_checkpoint):
    _, path = hf_checkpoint("qwen2")
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(raw | {"dtype": "bfloat16"}))
    model, config = load_model(path)
    assert config.torch_dtype == torch.bfloat16
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # CPU default: fp32
    model, _ = load_model(path, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.cos_sin.dtype == torch.float32
    assert torch.get_default_dtype() == torch.float32  # the build context restored it


def test_dummy_weights(hf_checkpoint, random_batch, our_logits):
    _, path = hf_checkpoint("qwen3")
    (path / CKPT).unlink()  # dummy must not need weights
    a, config = load_model(path, load_format="dummy", seed=1)
    b, _ = load_model(path, load_format="dummy", seed=1)
    c, _ = load_model(path, load_format="dummy", seed=2)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[n], sb[n]) for n in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])
    assert torch.equal(sa["model.norm.weight"], torch.ones(config.hidden_size))
    assert torch.equal(sa["model.layers.0.self_attn.q_norm.weight"], torch.ones(config.head_dim))
    assert 0.015 < sa["model.layers.0.mlp.down_proj.weight"].std() < 0.025
    assert torch.isfinite(our_logits(a, random_batch(config.vocab_size))).all()


def test_dummy_bf16(hf_checkpoint):
    _, path = hf_checkpoint("llama")
    model, _ = load_model(path, load_format="dummy", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_bad_load_format(hf_checkpoint):
    _, path = hf_checkpoint("llama")
    with pytest.raises(ValueError, match="load_format"):
        load_model(path, load_format="pt")
