"""``sparse_methods.hf.SparseKVCache``: eviction methods inside HF ``model.generate`` / ``pipeline``.

Greedy tokens through the integration equal ``sparse_serve.LLM`` with the same method and parameters
(tiny random Llama and Qwen3 models, fp32 CPU), with evictions during decode so that positions after
eviction matter; kept sets after a prefill equal NVIDIA kvpress's presses where kvpress has one.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import DEFAULT_MODEL
from transformers import DynamicCache

from sparse_methods.hf import SparseKVCache
from sparse_serve import LLM, SamplingParams

PROMPT_LEN = 150
NEW_TOKENS = 24

# Budgets well under the prompt, and evictions during decode (every few tokens) for every method.
METHODS = {
    "streamingllm": dict(sink_keep_tokens=4, recent_keep_tokens=28, decode_eviction_interval=4),
    "snapkv": dict(
        sink_keep_tokens=4,
        decode_keep_tokens=24,
        recent_keep_tokens=16,
        observation_window_size=8,
        decode_eviction_interval=6,
    ),
    "pyramidkv": dict(
        sink_keep_tokens=0,
        decode_keep_tokens=40,
        recent_keep_tokens=8,
        observation_window_size=8,
        pyramidkv_beta=2.0,
        decode_eviction_interval=6,
    ),
    "h2o": dict(h2o_prefill_budget=48, h2o_decode_budget=40, decode_eviction_interval=5, h2o_per_head=True),
}


def _prompt(seed: int, n: int = PROMPT_LEN) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 384, (n,), generator=g).tolist()


def _hf_generate(model, prompts: list[list[int]], cache=None, max_new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    ids = torch.tensor(prompts)
    with torch.no_grad():
        greedy = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
        out = model.generate(ids, past_key_values=cache, max_new_tokens=max_new_tokens, **greedy)
    return out[:, ids.shape[1] :].tolist()


def _engine_generate(path, prompt: list[int], method: str, params: dict, max_tokens: int = NEW_TOKENS) -> list[int]:
    llm = LLM(
        str(path),
        device="cpu",
        dtype="float32",
        block_size=16,
        max_num_batched_tokens=4096,
        sparse_method=method,
        **params,
    )
    out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))[0]
    return list(out.token_ids)


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_generate_equals_engine(tiny_checkpoint, family, method):
    path, model = tiny_checkpoint(family)
    params = METHODS[method]
    prompt = _prompt(7)
    with SparseKVCache(model, method, **params) as cache:
        [ours] = _hf_generate(model, [prompt], cache)
    assert ours == _engine_generate(path, prompt, method, params)
    # The method really evicted, during decode too, and that changed the tokens.
    assert cache.num_tokens == PROMPT_LEN + NEW_TOKENS - 1  # the last sampled token is never fed back
    assert max(cache.kv_lens()) < 80
    assert ours != _hf_generate(model, [prompt])[0]
    assert model.config._attn_implementation == "sdpa"  # restored on exit


def test_positions_after_eviction(tiny_checkpoint):
    """StreamingLLM's kept positions are exactly sink + recent in logical positions after several decode evictions,
    and decoding from the kept slots at those positions equals a dense model fed only the kept tokens (same RoPE)."""
    _, model = tiny_checkpoint("llama")
    prompt = _prompt(8)
    with SparseKVCache(
        model, "streamingllm", sink_keep_tokens=4, recent_keep_tokens=28, decode_eviction_interval=4
    ) as cache:
        _hf_generate(model, [prompt], cache)
    n = cache.num_tokens
    for layer in range(model.config.num_hidden_layers):
        kept = cache.kept_positions(layer)[0, 0].tolist()
        assert kept[:4] == [0, 1, 2, 3]
        assert kept[4:] == list(range(n - len(kept) + 4, n))
        assert len(kept) - 4 >= 28 and len(kept) - 4 < 28 + 4  # evicted back every 4 tokens


@pytest.mark.parametrize("method", sorted(METHODS))
def test_second_turn_equals_engine_chain(tiny_checkpoint, method):
    """``generate`` again with the same cache and the whole history continues from the kept KV, as a chain
    resumed in the engine does (only the new tokens are computed; positions continue)."""
    path, model = tiny_checkpoint("qwen3")
    params = METHODS[method]
    first, extra = _prompt(14), _prompt(15, 40)
    llm = LLM(str(path), device="cpu", dtype="float32", max_num_batched_tokens=4096, sparse_method=method, **params)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    turn1 = llm.generate([first], greedy, chain_id="conv")[0]
    history = first + list(turn1.token_ids) + extra
    turn2 = llm.generate([history], greedy, chain_id="conv")[0]
    assert turn2.chain_status == "resumed"
    with SparseKVCache(model, method, **params) as cache:
        assert _hf_generate(model, [first], cache) == [list(turn1.token_ids)]
        assert _hf_generate(model, [history], cache) == [list(turn2.token_ids)]
    assert cache.num_tokens == len(history) + NEW_TOKENS - 1


def test_batch_rows_equal_single_rows(tiny_checkpoint):
    _, model = tiny_checkpoint("qwen3")
    prompts = [_prompt(9), _prompt(10)]
    params = METHODS["snapkv"]
    with SparseKVCache(model, "snapkv", **params) as cache:
        both = _hf_generate(model, prompts, cache)
    for prompt, row in zip(prompts, both, strict=True):
        with SparseKVCache(model, "snapkv", **params) as cache:
            assert _hf_generate(model, [prompt], cache) == [row]


def test_refuses_what_it_does_not_model(tiny_checkpoint):
    _, model = tiny_checkpoint("llama")
    with pytest.raises(ValueError, match="eviction methods"):
        SparseKVCache(model, "quest")
    with pytest.raises(ValueError, match="has no parameter"):
        SparseKVCache(model, "snapkv", h2o_prefill_budget=8)
    with pytest.raises(ValueError, match="ragged per-head counts"):
        SparseKVCache(model, "adakv")
    padded = torch.tensor([[0, 0] + _prompt(11, 20), _prompt(12, 22)])
    mask = torch.ones_like(padded)
    mask[0, :2] = 0
    with SparseKVCache(model, "snapkv", **METHODS["snapkv"]) as cache, pytest.raises(ValueError, match="padded"):
        model.generate(padded, attention_mask=mask, past_key_values=cache, max_new_tokens=2, pad_token_id=0)
    assert model.config._attn_implementation == "sdpa"


def test_pipeline_equals_engine_text():
    """``pipeline("text-generation")`` on the embedded checkpoint with its tokenizer, through the cache."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    text = DEFAULT_MODEL.joinpath("README.md").read_text()[:1200]
    params = dict(sink_keep_tokens=4, decode_keep_tokens=64, recent_keep_tokens=32, decode_eviction_interval=8)
    with SparseKVCache(model, "snapkv", **params) as cache:
        ours = pipe(text, past_key_values=cache, max_new_tokens=16, do_sample=False, return_full_text=False)
    assert max(cache.kv_lens()) < cache.num_tokens - 100
    llm = LLM(
        str(DEFAULT_MODEL), device="cpu", dtype="float32", max_num_batched_tokens=4096, sparse_method="snapkv", **params
    )
    theirs = llm.generate([text], SamplingParams(max_tokens=16, temperature=0.0))[0]
    assert ours[0]["generated_text"] == theirs.text


# -- kept sets against kvpress (prefill only: kvpress's presses compress the prompt) ---------------------


def _kvpress_presses():
    from kvpress import PyramidKVPress, SnapKVPress, StreamingLLMPress

    n = PROMPT_LEN
    return {
        "streamingllm": (
            StreamingLLMPress(compression_ratio=0.6, n_sink=4),
            dict(sink_keep_tokens=4, recent_keep_tokens=int(n * 0.4) - 4),
        ),
        "snapkv": (
            SnapKVPress(compression_ratio=0.5, window_size=64, kernel_size=5),
            dict(
                sink_keep_tokens=0,
                recent_keep_tokens=64,
                observation_window_size=64,
                decode_keep_tokens=int(n * 0.5) - 64,
                score_kernel_size=5,
                score_pooling="avg",
                score_gqa_reduce="mean",
            ),
        ),
        "pyramidkv": (
            PyramidKVPress(compression_ratio=0.5, window_size=8, kernel_size=5, beta=2),
            dict(
                sink_keep_tokens=0,
                recent_keep_tokens=8,
                observation_window_size=8,
                decode_keep_tokens=int(n * 0.5) - 8,
                score_kernel_size=5,
                score_pooling="avg",
                pyramidkv_beta=2.0,
            ),
        ),
    }


def _positions(kept: torch.Tensor, dense: torch.Tensor) -> list[int]:
    """Sorted positions of ``kept`` ``[n, D]`` keys among ``dense`` ``[L, D]`` (kvpress keeps slots in score order)."""
    best = torch.cdist(kept.double(), dense.double()).min(dim=1)
    assert float(best.values.max()) < 1e-4, "a kept key matches no dense key"
    return sorted(best.indices.tolist())


@pytest.mark.parametrize("method", ["streamingllm", "snapkv", "pyramidkv"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_kept_sets_equal_kvpress(tiny_checkpoint, family, method):
    _, model = tiny_checkpoint(family)
    press, params = _kvpress_presses()[method]
    ids = torch.tensor([_prompt(13)])
    dense, theirs = DynamicCache(), DynamicCache()
    with torch.no_grad():
        model(ids, past_key_values=dense)
        with press(model):
            model(ids, past_key_values=theirs)
        with SparseKVCache(model, method, **params) as ours:
            model(ids, past_key_values=ours)
    differs = False
    for layer in range(model.config.num_hidden_layers):
        kept = ours.kept_positions(layer)[0]  # [Hkv, n]
        for head, row in enumerate(kept):
            assert row.tolist() == _positions(theirs.layers[layer].keys[0, head], dense.layers[layer].keys[0, head])
            torch.testing.assert_close(ours.layers[layer].keys[0, head], dense.layers[layer].keys[0, head, row])
            torch.testing.assert_close(ours.layers[layer].values[0, head], dense.layers[layer].values[0, head, row])
        differs |= not torch.equal(kept[0], kept[1])
    assert differs == (method != "streamingllm")  # score-driven methods keep different tokens per KV head


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_long_generate_equals_engine(tiny_checkpoint, family, method):
    """Every family, a 400-token prompt and 64 new tokens: many decode evictions (run with ``-m slow``)."""
    path, model = tiny_checkpoint(family)
    params = METHODS[method]
    prompt = _prompt(21, 400)
    with SparseKVCache(model, method, **params) as cache:
        [ours] = _hf_generate(model, [prompt], cache, max_new_tokens=64)
    assert ours == _engine_generate(path, prompt, method, params, max_tokens=64)
    assert cache.num_tokens == 400 + 64 - 1 and max(cache.kv_lens()) < 100
