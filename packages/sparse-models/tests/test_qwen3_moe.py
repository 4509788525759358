"""Qwen3-MoE: logits equal HF's (fp32) with dense and routed layers mixed, the router equals HF's, and
checkpoints load from per-expert tensors (HF's layout, sharded, written here) and from the fused layout,
with a missing expert named."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from sparse_models import CheckpointError, ModelConfig, load_model
from sparse_models.layers.moe import FusedExperts, route_expert_weight
from sparse_models.layers.router import softmax_topk

ATOL = 1e-4


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize(("sparse_step", "mlp_only"), [(1, [1]), (2, [])], ids=["only1", "step2"])
def test_logits_match_hf(norm_topk_prob, sparse_step, mlp_only, hf_checkpoint, random_batch, our_logits, hf_logits):
    hf_model, path = hf_checkpoint(
        "qwen3_moe", norm_topk_prob=norm_topk_prob, decoder_sparse_step=sparse_step, mlp_only_layers=mlp_only
    )
    model, config = load_model(path)
    kinds = [
        "sparse" if type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" else "dense" for layer in hf_model.model.layers
    ]
    assert list(config.mlp_layer_types) == kinds and "sparse" in kinds and "dense" in kinds
    seqs = random_batch(config.vocab_size)
    torch.testing.assert_close(our_logits(model, seqs), hf_logits(hf_model, seqs), atol=ATOL, rtol=0)


@pytest.mark.parametrize("renormalize", [True, False])
def test_router_matches_hf(renormalize):
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = transformers.Qwen3MoeConfig(
        hidden_size=24, num_experts=16, num_experts_per_tok=4, norm_topk_prob=renormalize
    )
    router = Qwen3MoeTopKRouter(config)
    torch.nn.init.normal_(router.weight, std=0.5)
    x = torch.randn(9, 24, generator=torch.Generator().manual_seed(0))
    _, hf_weights, hf_ids = router(x)
    weights, ids = softmax_topk(x @ router.weight.detach().T, 4, renormalize)
    assert torch.equal(ids, hf_ids) and weights.dtype == torch.float32
    torch.testing.assert_close(weights, hf_weights.detach())


def test_config_reads_either_expert_count_key_and_the_layer_rule():
    raw = dict(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=16,
        num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1, head_dim=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=8, decoder_sparse_step=2, mlp_only_layers=[3],
    )  # fmt: skip
    config = ModelConfig.from_hf_dict(raw)
    assert config.mlp_layer_types == ("dense", "sparse", "dense", "dense", "dense", "sparse")
    assert config.moe.num_experts == 4 and config.moe.top_k == 2 and not config.moe.norm_topk_prob
    renamed = {k: v for k, v in raw.items() if k != "num_experts"} | {"num_local_experts": 4}  # transformers 5
    assert ModelConfig.from_hf_dict(renamed).moe == config.moe
    assert config.qk_norm and config.head_dim == 4


def _write_shards(path, tensors: dict[str, torch.Tensor], num_shards: int) -> None:
    """A sharded safetensors checkpoint with its index, names dealt round-robin over the shards."""
    names = sorted(tensors)
    weight_map = {}
    for s in range(num_shards):
        file = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        shard = {n: tensors[n].contiguous() for n in names[s::num_shards]}
        save_file(shard, str(path / file))
        weight_map.update(dict.fromkeys(shard, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _fused(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same weights with each layer's experts stacked (transformers 5's in-memory layout)."""
    out, experts = {}, {}
    for name, t in tensors.items():
        routed = route_expert_weight(name)
        if routed is None:
            out[name] = t
        else:
            experts.setdefault(routed[0], {})[routed[1]] = t
    for stacked, parts in experts.items():
        num = 1 + max(e for e, _ in parts)
        if stacked.endswith("down_proj"):
            out[stacked] = torch.stack([parts[(e, "down")] for e in range(num)])
        else:
            out[stacked] = torch.stack([torch.cat([parts[(e, "gate")], parts[(e, "up")]]) for e in range(num)])
    return out


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_self_written_sharded_checkpoint_round_trip(layout, hf_checkpoint, tmp_path_factory, random_batch, our_logits):
    hf_model, path = hf_checkpoint("qwen3_moe")
    reference, config = load_model(path)
    tensors = {n: t.detach().clone() for n, t in hf_model.state_dict().items()}
    assert any(".experts.gate_up_proj" in n for n in tensors)  # transformers 5 keeps experts fused in memory
    per_expert = _unfused(tensors)  # the Hub's names: one tensor per expert and projection
    out = tmp_path_factory.mktemp(layout)
    (out / "config.json").write_text((path / "config.json").read_text())
    _write_shards(out, per_expert if layout == "per_expert" else _fused(per_expert), num_shards=3)
    model, _ = load_model(out)
    ours = dict(model.named_parameters())
    for name, param in reference.named_parameters():
        assert torch.equal(ours[name], param), name
    seqs = random_batch(config.vocab_size)
    torch.testing.assert_close(our_logits(model, seqs), our_logits(reference, seqs), atol=0, rtol=0)


def test_missing_expert_is_named(hf_checkpoint, tmp_path_factory):
    hf_model, path = hf_checkpoint("qwen3_moe")
    model, _ = load_model(path)
    tensors = {n: t.detach().clone() for n, t in model.state_dict().items()}
    missing = "model.layers.0.mlp.experts.5.up_proj.weight"
    per_expert = {k: v for k, v in _unfused(tensors).items() if k != missing}
    out = tmp_path_factory.mktemp("missing")
    (out / "config.json").write_text((path / "config.json").read_text())
    _write_shards(out, per_expert, num_shards=2)
    with pytest.raises(CheckpointError, match=r"experts\.gate_up_proj\[\(5, 'up'\)\]"):
        load_model(out)


def _unfused(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in tensors.items():
        if name.endswith("experts.gate_up_proj"):
            for e, gate_up in enumerate(t):
                gate, up = gate_up.chunk(2)
                out[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate
                out[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = up
        elif name.endswith("experts.down_proj"):
            out.update({name.replace("down_proj", f"{e}.down_proj.weight"): d for e, d in enumerate(t)})
        else:
            out[name] = t
    return out


def test_route_and_loader_reject_wrong_targets():
    assert route_expert_weight("model.layers.3.mlp.experts.17.up_proj.weight") == (
        "model.layers.3.mlp.experts.gate_up_proj",
        (17, "up"),
    )
    assert route_expert_weight("model.layers.3.mlp.gate_proj.weight") is None  # a dense MLP
    assert route_expert_weight("model.layers.3.mlp.shared_experts.gate_proj.weight") is None
    experts = FusedExperts(4, 2, 8, 6)
    with pytest.raises(ValueError, match="out of range"):
        experts.weight_loader(experts.gate_up_proj, torch.zeros(6, 8), (4, "gate"))
    with pytest.raises(ValueError, match="does not belong"):
        experts.weight_loader(experts.gate_up_proj, torch.zeros(8, 6), (0, "down"))


def test_bytes_read_counts_expected_distinct_experts():
    experts = FusedExperts(128, 8, 16, 4)
    per_expert = (2 * 4 * 16 + 16 * 4) * 4  # fp32
    assert experts.bytes_read(1) == pytest.approx(8 * per_expert)  # one token: exactly its k experts
    assert experts.bytes_read(2) == pytest.approx(128 * (1 - (120 / 128) ** 2) * per_expert)
    assert experts.bytes_read(4096) == pytest.approx(128 * per_expert)  # large batch: all of them


def test_dummy_weights(hf_checkpoint, random_batch, our_logits):
    _, path = hf_checkpoint("qwen3_moe")
    model, config = load_model(path, load_format="dummy", seed=3)
    logits = our_logits(model, random_batch(config.vocab_size))
    assert torch.isfinite(logits).all()
    again, _ = load_model(path, load_format="dummy", seed=3)
    assert torch.equal(again.model.layers[0].mlp.experts.down_proj, model.model.layers[0].mlp.experts.down_proj)
