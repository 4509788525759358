"""Tensor-parallel engine: 2 and 4 gloo ranks (CPU, fp32; ``LLM`` starts the ranks) give the greedy
tokens of one rank for a dense (Qwen3: KV heads split at 2 ranks, replicated at 4) and a MoE model
(Qwen3-MoE), and at 2 and 4 ranks for the MLA models (DeepSeek-V2; GLM-4.7-Flash dense only: heads
split, the latent whole on every rank), with dense attention, SnapKV (evicting) and Quest (selecting
pages); and every other method on Qwen3 at 2 ranks (those that combine KV heads over the ranks,
``HeadReduction``, at 4 as well: replicated heads count once; RetroInfer at 4 too: its estimated clusters
are merged per rank; its prompts pass its 256-slot row), with budgets under the prompts so that
each evicts or selects (its tokens differ from dense's; the compressed stores are exact stores of
another kind and may not). KVzip runs on the embedded checkpoint (its replays need a tokenizer). The
2-rank Qwen3 cases of dense, SnapKV, Quest and H2O (shared scores: a sum over the ranks) and
DeepSeek-V2 with SnapKV run by default; the rest of the matrix is slow."""

from __future__ import annotations

import functools
import random

import pytest
import torch
from tiny_models import family_config

from sparse_methods import Support
from sparse_methods.methods.tova import TOVA
from sparse_serve import LLM, SamplingParams

METHODS = {
    "dense": {},
    # Budgets well under the 40-token prompt: SnapKV evicts, Quest reads a few pages.
    "snapkv": dict(sink_keep_tokens=2, decode_keep_tokens=8, recent_keep_tokens=8, observation_window_size=4),
    "quest": dict(
        sink_keep_tokens=4, decode_keep_tokens=8, recent_keep_tokens=4, quest_chunk_size=4, quest_skip_layers=0
    ),
    "h2o": dict(h2o_prefill_budget=12, h2o_decode_budget=10, decode_eviction_interval=4),  # shared scores
    "streamingllm": dict(sink_keep_tokens=2, recent_keep_tokens=8, decode_eviction_interval=4),
    "tova": dict(decode_keep_tokens=8),
    "rkv": dict(
        sink_keep_tokens=2,
        decode_keep_tokens=6,
        recent_keep_tokens=4,
        rkv_compression_interval=4,
        rkv_observation_tokens=4,
    ),
    "pyramidkv": dict(sink_keep_tokens=2, decode_keep_tokens=8, recent_keep_tokens=4, observation_window_size=4),
    "omnikv": dict(sink_keep_tokens=2, decode_keep_tokens=6, recent_keep_tokens=4, full_attention_layers="1"),
    "omnikv_prefill": dict(  # OmniKV whose prefill chunks after the filter layer read a selected history
        sparse_method="omnikv",
        sink_keep_tokens=2,
        decode_keep_tokens=6,
        recent_keep_tokens=4,
        full_attention_layers="1",
        prefill_sparse_method="omnikv_prefill",
        prefill_sink_tokens=2,
        prefill_keep_tokens=4,
        prefill_recent_tokens=2,
        max_num_batched_tokens=16,
    ),
    "retroinfer": dict(
        retroinfer_sink_tokens=2,
        retroinfer_recent_tokens=4,
        retroinfer_min_index_tokens=16,
        retroinfer_update_tokens=8,
        retroinfer_avg_cluster_size=4,
        retroinfer_retrieval_ratio=0.25,  # and the default estimation ratio: estimated clusters merge per rank
    ),
    "fp8_kv": {},
    "kivi": {"block_size": 16},  # its page (the block) is 16 to 128 tokens
    "turboquant": {},
}
BASE = ("dense", "snapkv", "quest")  # on every family
COMPRESSED = frozenset({"fp8_kv", "kivi", "turboquant"})  # every token kept: their tokens may equal dense's
REDUCING = (
    "h2o",
    "tova",
    "omnikv",
    "omnikv_prefill",
)  # combine KV heads over the ranks (HeadReduction)
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made = {}

    def make(family: str) -> str:
        if family not in made:
            config, model_cls = family_config(family)
            torch.manual_seed(0)
            made[family] = str(tmp_path_factory.mktemp(family))
            model_cls(config).save_pretrained(made[family])
        return made[family]

    return make


# RetroInfer's decode row is at least 256 slots wide (``retroinfer.WIDTH_QUANTUM``): under that it reads every token
# exactly, as dense does, so its prompts are longer than the row.
PROMPT_LENGTHS = {"retroinfer": (5, 300, 280)}


@functools.cache  # a method's one-rank run serves every world size
def _greedy(path: str, world: int, method: str, lengths: tuple[int, ...]) -> list[tuple[int, ...]]:
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 384) for _ in range(n)] for n in lengths]
    params = {"block_size": 4, "sparse_method": method, **METHODS[method]}
    llm = LLM(path, device="cpu", tensor_parallel_size=world, **params)
    try:
        return [out.token_ids for out in llm.generate(prompts, PARAMS)]
    finally:
        llm.close()


CASES = (
    [
        pytest.param(family, world, method, marks=() if (family, world) == ("qwen3", 2) else pytest.mark.slow)
        for family in ("qwen3", "qwen3_moe")
        for world in (2, 4)
        for method in BASE
    ]
    + [  # MLA: heads split, the latent whole on every rank
        pytest.param("deepseek_v2", 2, method, marks=() if method == "snapkv" else pytest.mark.slow) for method in BASE
    ]
    + [pytest.param("deepseek_v2", 4, method, marks=pytest.mark.slow) for method in BASE]
    + [pytest.param("deepseek_v2", 2, "h2o", marks=pytest.mark.slow)]  # a shared score over the one latent head
    + [pytest.param("glm4_moe_lite", 2, "dense", marks=pytest.mark.slow)]
    # RetroInfer with replicated KV heads: each rank merges its own query heads' part of the group's estimation
    + [pytest.param("qwen3", 4, "retroinfer", marks=pytest.mark.slow)]
    + [  # every other method but AdaKV and KVzip (their head-major store is refused under TP)
        pytest.param("qwen3", world, method, marks=() if (method, world) == ("h2o", 2) else pytest.mark.slow)
        for method in METHODS
        if method not in BASE
        for world in ((2, 4) if method in REDUCING else (2,))
    ]
)


@pytest.mark.parametrize(("family", "world", "method"), CASES)
def test_ranks_give_one_ranks_tokens(checkpoint, family, world, method):
    path = checkpoint(family)
    lengths = PROMPT_LENGTHS.get(method, (5, 40, 23))
    expected = _greedy(path, 1, method, lengths)
    if method != "dense" and method not in COMPRESSED:  # the method really changes what is read
        assert expected != _greedy(path, 1, "dense", lengths)
    assert _greedy(path, world, method, lengths) == expected


def test_method_without_tensor_parallel_is_an_error(checkpoint, monkeypatch):
    """A method without split heads, or a length over the model's limit: a clear error before any rank starts."""
    import sparse_serve.tensor_parallel as tensor_parallel

    def no_ranks(*args, **kwargs):
        raise AssertionError("a rank was started before the config was checked")

    monkeypatch.setattr(tensor_parallel.mp, "get_context", no_ranks)
    monkeypatch.setattr(TOVA, "supports", TOVA.supports - {Support.TENSOR_PARALLEL})  # every registered method has it
    with pytest.raises(ValueError, match="tova does not support tensor_parallel_size"):
        LLM(checkpoint("qwen3"), device="cpu", tensor_parallel_size=2, sparse_method="tova")
    # The head-major store's ranks would hold different block counts under one schedule.
    with pytest.raises(ValueError, match="adakv does not support tensor_parallel_size"):
        LLM(checkpoint("qwen3"), device="cpu", tensor_parallel_size=2, sparse_method="adakv")
    with pytest.raises(ValueError, match="exceeds the model's limit"):
        LLM(checkpoint("qwen3"), device="cpu", tensor_parallel_size=2, max_model_len=10**7)


def test_pruning_under_tensor_parallelism_is_refused(checkpoint):
    """Pruning's scratch scorer is not split over ranks yet: a clear error, and the engine still serves."""
    from sparse_serve.prune import PruneError

    llm = LLM(checkpoint("qwen3"), device="cpu", block_size=4, tensor_parallel_size=2)
    try:
        prompt = list(range(3, 40))
        with pytest.raises(PruneError, match="tensor parallelism") as err:
            llm.prune(prompt, [(4, 20)], keep_tokens=4)
        assert err.value.code == "prune_unsupported"
        assert len(llm.generate([prompt], PARAMS)[0].token_ids) == PARAMS.max_tokens
    finally:
        llm.close()
