"""``host_threads``: torch's CPU threads for a CUDA engine's host work (1 by default, 0 leaves torch's setting),
sayable in LLM(...), JSON and the CLI alike; a CPU engine, whose model runs on those threads, keeps them."""

from __future__ import annotations

import json

import pytest
import torch

from sparse_serve.cli import DEFAULT_MODEL, build_parser, engine_config_from_args
from sparse_serve.config import EngineConfig


def test_default_one_and_zero_leaves_torch_alone(tmp_path):
    assert EngineConfig(model="m").host_threads == 1
    assert EngineConfig(model="m", host_threads=0).host_threads == 0
    with pytest.raises(ValueError):
        EngineConfig(model="m", host_threads=-1)
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"model": "m", "host_threads": 4}))
    assert EngineConfig.from_json(path).host_threads == 4
    args = build_parser().parse_args(["generate", "--model", "m", "--host-threads", "0", "--prompt", "x"])
    assert engine_config_from_args(args).host_threads == 0


def test_a_cpu_engine_keeps_torchs_threads():
    from sparse_serve import LLM

    before = torch.get_num_threads()
    LLM(str(DEFAULT_MODEL), device="cpu", host_threads=1, max_model_len=256)
    assert torch.get_num_threads() == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_engine_sets_its_host_threads():
    from sparse_serve import LLM

    before = torch.get_num_threads()
    try:
        LLM(str(DEFAULT_MODEL), device="cuda", host_threads=1, max_model_len=256, num_kv_blocks=64)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
