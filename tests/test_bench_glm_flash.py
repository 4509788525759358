"""The GLM-4.7-Flash-shaped bench config parses to the published shape (MLA + 64 routed experts), and
``sparse-serve bench`` runs a shrunken copy of it with dummy weights on the CPU, counting a latent
row (not a K and a V) per cached token."""

from __future__ import annotations

import json

from sparse_models import read_model_config
from sparse_serve.bench.command import DEFAULT_BENCH_MODEL
from sparse_serve.cli import main

GLM_FLASH = DEFAULT_BENCH_MODEL.parent / "glm-4.7-flash"
SHRINK = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
    kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, vocab_size=512, max_position_embeddings=512,
)  # fmt: skip


def test_glm_flash_config_is_the_published_shape():
    config = read_model_config(GLM_FLASH)
    assert config.architecture == "Glm4MoeLiteForCausalLM"
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (47, 2048, 20)
    mla = config.mla
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim) == (768, 512, 192, 64)
    assert (config.num_key_value_heads, config.head_dim, mla.v_head_dim) == (1, 576, 256)
    moe = config.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.num_shared_experts) == (64, 4, 1536, 1)
    assert (moe.scoring, moe.routed_scaling_factor, moe.norm_topk_prob) == ("sigmoid", 1.8, True)
    assert config.mlp_layer_types == ("dense",) + ("sparse",) * 46
    assert config.max_position_embeddings >= 128 * 1024 + 2048


def test_bench_runs_a_shrunken_glm_flash(tmp_path):
    raw = json.loads((GLM_FLASH / "config.json").read_text()) | SHRINK
    (tmp_path / "config.json").write_text(json.dumps(raw))
    argv = ["bench", "--model", str(tmp_path), "--device", "cpu", "--num-kv-blocks", "24", "--prompt-len", "40"]
    argv += ["--output-len", "3", "--warmup-steps", "1", "--batch-size", "1,max", "--out", str(tmp_path / "out")]
    assert main([*argv, "--no-progress"]) == 0
    (inv,) = json.loads((tmp_path / "out" / "bench.json").read_text())["invocations"]
    runs = inv["runs"]
    assert [r["batch_size_arg"] for r in runs] == [1, "max"] and runs[-1]["batch_size"] == 24 // 3
    row = (32 + 8) * 4  # latent + rope channels, fp32 on the CPU
    assert all(r["raw"]["kv_bytes_per_slot"] == row and r["metrics"]["tokens_per_s"] > 0 for r in runs)
    assert runs[0]["kv_bytes_per_block"] == 3 * 16 * row
