"""Tensor-parallel layers: 2 and 4 gloo ranks (CPU, fp32) compute the logits of one rank, from a
checkpoint and from dummy weights, for a dense GQA model (KV heads split at 2 ranks, replicated at 4),
a MoE model (every expert's width split), Qwen2 (biases, tied head, a vocabulary that the ranks do
not divide) and the MLA models DeepSeek-V2 and GLM-4.7-Flash (heads split: q / q_b and kv_b's W_UK /
W_UV rows, the latent replicated; shared experts split like the MLP); the ranks are launched here,
once per rank count."""

from __future__ import annotations

import pytest
import torch
from tiny_models import family_config
from tp_ranks import logits_on_ranks, model_logits

CASES = {"qwen3": {}, "qwen3_moe": {}, "qwen2": {"vocab_size": 385}, "deepseek_v2": {}, "glm4_moe_lite": {}}


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ranks_match_one_rank(tmp_path, world):
    cases = []
    for family, overrides in CASES.items():
        config, model_cls = family_config(family)
        for key, value in overrides.items():
            setattr(config, key, value)
        torch.manual_seed(0)
        model_cls(config).save_pretrained(tmp_path / family)
        cases += [(str(tmp_path / family), "auto"), (str(tmp_path / family), "dummy")]
    expected = [model_logits(path, load_format) for path, load_format in cases]
    for case, got, want in zip(cases, logits_on_ranks(world, cases, tmp_path), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m, case=case: f"{case}: {m}")
