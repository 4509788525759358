"""Layer building blocks: shard loading, RoPE frequencies against HF's, RMSNorm."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from sparse_models.config import RopeScaling
from sparse_models.layers import MergedLinear, RMSNorm, apply_rotary, default_inv_freq, llama3_inv_freq


def test_merged_linear_shards_and_fused():
    layer = MergedLinear(3, {"q": 4, "k": 2, "v": 2}, bias=True)
    parts = {s: torch.randn(n, 3) for s, n in layer.shard_sizes.items()}
    biases = {s: torch.randn(n) for s, n in layer.shard_sizes.items()}
    for s in ("v", "q", "k"):  # any order
        layer.weight.weight_loader(layer.weight, parts[s], s)
        layer.bias.weight_loader(layer.bias, biases[s], s)
    x = torch.randn(5, 3)
    for y, s in zip(layer.split(layer(x)), ("q", "k", "v"), strict=True):
        torch.testing.assert_close(y, x @ parts[s].T + biases[s])
    fused = torch.cat(list(parts.values()))
    layer.weight.weight_loader(layer.weight, fused)
    assert torch.equal(layer.weight, fused)
    with pytest.raises(ValueError, match="shard id"):
        layer.weight.weight_loader(layer.weight, parts["q"], "o")
    with pytest.raises(ValueError, match="shape mismatch"):
        layer.weight.weight_loader(layer.weight, parts["q"], "k")


@pytest.mark.parametrize("theta", [1e4, 5e5])
def test_llama3_inv_freq_matches_hf(theta):
    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    config = transformers.LlamaConfig(
        hidden_size=1024,
        num_attention_heads=8,
        max_position_embeddings=131072,
        rope_theta=theta,
        rope_scaling={"rope_type": "llama3", **scaling},
    )
    hf_inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = llama3_inv_freq(default_inv_freq(128, theta), RopeScaling("llama3", **scaling))
    assert attention_scaling == 1.0
    torch.testing.assert_close(ours, hf_inv_freq, atol=0, rtol=0)
    assert not torch.equal(ours, default_inv_freq(128, theta))


def test_apply_rotary_matches_rotate_half():
    x = torch.randn(5, 3, 8)
    angles = torch.randn(5, 4)
    cos, sin = angles.cos(), angles.sin()
    rotate_half = torch.cat((-x[..., 4:], x[..., :4]), dim=-1)
    expected = x * torch.cat((cos, cos), -1)[:, None] + rotate_half * torch.cat((sin, sin), -1)[:, None]
    torch.testing.assert_close(apply_rotary(x, cos, sin), expected)


def test_rmsnorm():
    norm = RMSNorm(8, eps=1e-5)
    norm.weight.data.copy_(torch.randn(8))
    x = torch.randn(4, 8)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    torch.testing.assert_close(norm(x), expected)
