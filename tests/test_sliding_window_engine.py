"""Sliding-window models in the engine: greedy tokens equal HF transformers (fp32, CPU) on tiny Gemma 3
(local and global layers), Mistral and Qwen2 with windows shorter than the prompts, under paged
decode, chunked prefill and prefix caching; the window no longer caps the model length; methods that
support windows act on full-attention layers only, the others are refused."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import _COMMON as TINY_SHAPE
from tiny_models import hf_greedy

from sparse_serve import LLM, SamplingParams

MAX_NEW = 10
WINDOW = 6
_SHAPE = {**TINY_SHAPE, "sliding_window": WINDOW}
GEMMA_LAYERS = ["sliding_attention", "full_attention", "sliding_attention"]
MODELS = {
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        # Gemma scales the (tied) embedding by sqrt(hidden): a smaller init keeps its greedy tokens varied.
        dict(head_dim=16, query_pre_attn_scalar=24, layer_types=GEMMA_LAYERS, initializer_range=0.02),
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, max_window_layers=1)),
}
REGIMES = {
    "block1": dict(block_size=1),
    "block16": dict(block_size=16),
    "chunk7": dict(block_size=4, max_num_batched_tokens=7),
    "prefix_cache": dict(block_size=4, enable_prefix_caching=True),
}


@pytest.fixture(scope="module")
def window_checkpoint(tmp_path_factory):
    """``window_checkpoint(name)`` -> (folder, HF model in eval mode, fp32)."""
    import transformers as tf

    made = {}

    def make(name: str):
        if name not in made:
            config_cls, model_cls, extra = MODELS[name]
            torch.manual_seed(1234)
            model = getattr(tf, model_cls)(getattr(tf, config_cls)(**{**_SHAPE, **extra})).eval()
            with torch.no_grad():  # Gemma's (1 + w) norms start at 0: randomise them so a wrong route shows
                for pname, p in model.named_parameters():
                    if "norm" in pname or pname.endswith("bias"):
                        p.normal_(0.0, 0.2)
            path = tmp_path_factory.mktemp(name)
            model.save_pretrained(path)
            made[name] = (path, model)
        return made[name]

    return make


def _prompts(seed: int, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 384) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(3, 384) for _ in range(n)] for n in (5, 23, 1, 40)]


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    return [list(o.token_ids) for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("regime", list(REGIMES))
def test_greedy_matches_hf_with_windows(window_checkpoint, name, regime):
    path, hf_model = window_checkpoint(name)
    prompts = _prompts(seed=7, shared_prefix=12 if regime == "prefix_cache" else 0)
    expected = [hf_greedy(hf_model, p, MAX_NEW) for p in prompts]
    llm = LLM(str(path), device="cpu", dtype="float32", **REGIMES[regime])
    engine = llm.engine
    assert engine.max_model_len > WINDOW  # no longer capped at the window
    if regime == "prefix_cache":  # one prompt first, so its blocks are cached when the others arrive
        assert _greedy(llm, prompts[:1]) == expected[:1]
        assert _greedy(llm, prompts[1:]) == expected[1:]
        assert engine.prefix_hit_tokens >= 12 // 4 * 4 * (len(prompts) - 1)
    else:
        assert _greedy(llm, prompts) == expected
    assert engine.kv.pool.num_used_blocks == 0


def test_window_matters(window_checkpoint):
    """Guards the parity above: the prompts really outrun the window (HF without it disagrees)."""
    path, hf_model = window_checkpoint("gemma3")
    prompts = _prompts(seed=7)
    windowed = [hf_greedy(hf_model, p, MAX_NEW) for p in prompts]
    assert all(len(set(tokens)) > 2 for tokens in windowed)  # not a degenerate repetition
    hf_model.config.sliding_window = 10**6
    try:
        assert [hf_greedy(hf_model, p, MAX_NEW) for p in prompts] != windowed
    finally:
        hf_model.config.sliding_window = WINDOW


QUEST = dict(sparse_method="quest", quest_chunk_size=4, block_size=4)


def test_quest_budget_above_context_equals_dense(window_checkpoint):
    path, hf_model = window_checkpoint("gemma3")
    prompts = _prompts(seed=3)
    expected = [hf_greedy(hf_model, p, MAX_NEW) for p in prompts]
    big = dict(sink_keep_tokens=4, decode_keep_tokens=256, recent_keep_tokens=4, quest_skip_layers=0)
    assert _greedy(LLM(str(path), device="cpu", dtype="float32", **QUEST, **big), prompts) == expected


def test_quest_leaves_windowed_layers_alone(window_checkpoint):
    """Quest with a small budget on layers >= 2 only: layer 2 slides, so Quest must not touch it, and
    the tokens equal dense HF although every prompt is longer than the budget."""
    path, hf_model = window_checkpoint("gemma3")
    prompts = _prompts(seed=3)
    expected = [hf_greedy(hf_model, p, MAX_NEW) for p in prompts]
    small = dict(sink_keep_tokens=4, decode_keep_tokens=4, recent_keep_tokens=4, quest_skip_layers=2)
    assert _greedy(LLM(str(path), device="cpu", dtype="float32", **QUEST, **small), prompts) == expected


@pytest.mark.parametrize(
    ("params", "match"),
    [
        (dict(sparse_method="adakv"), "does not support models with sliding-window layers"),
        (dict(kv_cache_dtype="fp8"), "do not run over a fp8 KV store"),
    ],
)
def test_unsupported_combinations_are_errors(window_checkpoint, params, match):
    path, _ = window_checkpoint("mistral")
    with pytest.raises(ValueError, match=match):
        LLM(str(path), device="cpu", dtype="float32", **params)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["gemma3", "mistral"])
def test_cuda_graphs_with_windows_equal_eager(window_checkpoint, name):
    """On the GPU the windowed layers run the Triton kernels, decode under CUDA graphs (one group per layer:
    a table per layer) with the same tokens as eager; local layers give their blocks back as they slide."""
    path, _ = window_checkpoint(name)
    prompts = _prompts(seed=5)
    llms = [LLM(str(path), device="cuda", dtype="float32", block_size=4, enforce_eager=e) for e in (True, False)]
    runs = [_greedy(llm, prompts) for llm in llms]
    assert runs[0] == runs[1]
    assert llms[1].engine.kv.per_layer and llms[1].engine.runner.graphs.num_replays > 0


def test_local_layers_hold_only_their_window(window_checkpoint):
    """Gemma 3 with a table per layer: each local layer gives back its blocks before the window as the
    request advances (chunked prefill, prefix caching on, prompts longer than the window), holding at
    most ``ceil((window + chunk) / block_size) + 1`` blocks, while the global layer holds the whole
    context; greedy tokens still equal HF's and every block comes back."""
    path, hf_model = window_checkpoint("gemma3")
    bs, chunk = 4, 7
    prompts = _prompts(seed=7, shared_prefix=12)
    expected = [hf_greedy(hf_model, p, MAX_NEW) for p in prompts]
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=bs, max_num_batched_tokens=chunk)
    engine = llm.engine
    assert engine.kv.per_layer and engine.kv.layout.window_left == tuple(
        WINDOW - 1 if t == "sliding_attention" else None for t in GEMMA_LAYERS
    )
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    outputs, most_local = {}, 0
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=str(i))
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[out.request_id] = list(out.token_ids)
            for req in engine.scheduler.running:
                if not engine.kv.has_request(req.request_id):
                    continue
                for layer, kind in enumerate(GEMMA_LAYERS):
                    ids = engine.kv.table(req.request_id, layer).block_ids
                    held = [b for b in ids if b != engine.kv.null_block]
                    assert len(ids) == -(-req.kv_lens[layer] // bs)
                    if kind == "sliding_attention":
                        assert len(held) <= -(-(WINDOW + chunk) // bs) + 1
                        most_local = max(most_local, len(held))
                    else:
                        assert held == ids  # the global layer keeps every block
    assert [outputs[str(i)] for i in range(len(prompts))] == expected
    assert engine.prefix_hit_tokens > 0 and most_local > 0
    assert max(len(p) for p in prompts) + MAX_NEW > 4 * (WINDOW + chunk)  # the window really slides
    assert engine.kv.pool.num_used_blocks == 0
    with pytest.raises(ValueError, match="table per layer"):  # pruning copies one table: not here yet
        engine.prune(prompts[3], [(0, 8)], 2)


def test_synthetic_requests_take_only_the_window_in_local_layers(window_checkpoint):
    """Benchmarks' synthetic prefill on Gemma 3: a local layer holds only the blocks its window reads."""
    path, _ = window_checkpoint("gemma3")
    engine = LLM(str(path), device="cpu", dtype="float32", block_size=4).engine
    engine.add_synthetic_request(300, SamplingParams(max_tokens=2, ignore_eos=True), request_id="s")
    for layer, kind in enumerate(GEMMA_LAYERS):
        blocks = engine.kv.table("s", layer).block_ids
        held = [b for b in blocks if b != engine.kv.null_block]
        assert len(blocks) == 300 // 4 and len(held) == (300 // 4 if kind == "full_attention" else 2)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.pool.num_used_blocks == 0


def test_admission_sizes_local_layers_by_their_window(window_checkpoint):
    """Two 300-token prompts on a pool of 3 x 100 blocks of 4 tokens: sized by the whole context (3 x 78
    blocks each) one would wait for the other; a local layer holds about its window and a chunk (its
    table per layer over one pool), so both run at once, with HF's greedy tokens."""
    path, hf_model = window_checkpoint("gemma3")
    prompts = [p * 8 for p in _prompts(seed=11)[3:]] + [q * 8 for q in _prompts(seed=12)[3:]]
    prompts = [p[:300] for p in prompts]
    expected = [hf_greedy(hf_model, p, MAX_NEW) for p in prompts]
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=16, num_kv_blocks=100)
    engine = llm.engine
    assert engine.kv.num_blocks_for([310] * 3) > engine.kv.num_blocks // 2  # whole contexts: one at a time
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=str(i))
    outputs, most_running = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = list(out.token_ids)
        most_running = max(most_running, len(engine.scheduler.running))
    assert most_running == 2 and engine.scheduler.num_preemptions == 0
    assert [outputs["0"], outputs["1"]] == expected
