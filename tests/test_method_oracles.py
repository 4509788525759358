"""Kept token sets of the eviction methods equal independent oracles on tiny random HF models (CPU, fp32).

StreamingLLM, SnapKV and PyramidKV are compared with NVIDIA kvpress's presses configured the same
way; H2O with a plain implementation of the paper's algorithm written here. Our side runs the real
engine (one prefill step, then the pool is read); both sides' kept keys are mapped back to token
positions by matching them against the dense keys of the same prompt.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

from sparse_serve import LLM, SamplingParams
from sparse_serve.step_metadata import table_slots

PROMPT_LEN = 200


def _prompt(seed: int = 0, n: int = PROMPT_LEN) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 384, (n,), generator=g).tolist()


def _dense_keys(model, prompt) -> list[torch.Tensor]:
    """Per layer ``[Hkv, L, D]`` post-RoPE keys of a dense prefill."""
    cache = DynamicCache()
    with torch.no_grad():
        model(torch.tensor([prompt]), past_key_values=cache)
    return [layer.keys[0] for layer in cache.layers]


def _positions(kept: torch.Tensor, dense: torch.Tensor) -> set[int]:
    """Positions of ``kept`` ``[n, D]`` keys among ``dense`` ``[L, D]`` (nearest match, must be close)."""
    dist = torch.cdist(kept.double(), dense.double())
    best = dist.min(dim=1)
    assert float(best.values.max()) < 1e-3, "a kept key matches no dense key"
    return set(best.indices.tolist())


def _kvpress_kept(model, prompt, press) -> list[list[set[int]]]:
    dense = _dense_keys(model, prompt)
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model(torch.tensor([prompt]), past_key_values=cache)
    return [
        [_positions(layer.keys[0, h], dense[i][h]) for h in range(layer.keys.shape[1])]
        for i, layer in enumerate(cache.layers)
    ]


def _engine_kept(path, model, prompt, **method) -> list[list[set[int]]]:
    """Prefill ``prompt`` in one chunk through the engine, then read which tokens each (layer, head) kept."""
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=16, max_num_batched_tokens=4096, **method)
    engine = llm.engine
    rid = engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0.0))
    engine.step()  # the whole prompt, then the method's compaction
    req = engine.scheduler.running[0]
    dense = _dense_keys(model, prompt)
    kept = []
    for layer, kv_len in enumerate(req.kv_lens):
        table = engine.kv.table(rid, layer)  # every layer's, or its own with a table per layer (PyramidKV)
        slots = table_slots(table.block_ids, kv_len, engine.config.block_size)
        keys = engine.runner.kv.k[layer].view(-1, *engine.runner.kv.k[layer].shape[2:])[slots]  # [n, Hkv, D]
        kept.append([_positions(keys[:, h], dense[layer][h]) for h in range(keys.shape[1])])
        # Reclaim: the table holds exactly the blocks its longest layer (or this layer) needs.
        longest = kv_len if engine.kv.per_layer else max(req.kv_lens)
        assert len(table.block_ids) == math.ceil(longest / engine.config.block_size)
    engine.abort_request(rid)
    return kept


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.mark.parametrize("ratio", [0.3, 0.75])
def test_streamingllm_matches_kvpress(llama, ratio):
    from kvpress import StreamingLLMPress

    path, model = llama
    prompt = _prompt(1)
    n_kept = int(PROMPT_LEN * (1 - ratio))
    ours = _engine_kept(
        path, model, prompt, sparse_method="streamingllm", sink_keep_tokens=4, recent_keep_tokens=n_kept - 4
    )
    assert ours == _kvpress_kept(model, prompt, StreamingLLMPress(compression_ratio=ratio, n_sink=4))
    assert all(len(s) == n_kept for layer in ours for s in layer)


@pytest.mark.parametrize("ratio", [0.5, 0.65])
def test_snapkv_matches_kvpress(llama, ratio):
    """kvpress's SnapKV: window 64 (all kept), avg pooling k=5, mean over the window and the GQA group."""
    from kvpress import SnapKVPress

    path, model = llama
    prompt = _prompt(2)
    n_kept = int(PROMPT_LEN * (1 - ratio))
    ours = _engine_kept(
        path,
        model,
        prompt,
        sparse_method="snapkv",
        sink_keep_tokens=0,
        recent_keep_tokens=64,
        observation_window_size=64,
        decode_keep_tokens=n_kept - 64,
        score_kernel_size=5,
        score_pooling="avg",
        score_gqa_reduce="mean",
        score_mode="probability",
    )
    theirs = _kvpress_kept(model, prompt, SnapKVPress(compression_ratio=ratio, window_size=64, kernel_size=5))
    assert ours == theirs
    # The kept set is really score-driven: some heads keep different tokens.
    assert any(layer[0] != layer[1] for layer in ours)


def test_pyramidkv_matches_kvpress(llama):
    """kvpress's PyramidKV with a pyramid that fits a short prompt (window 8, beta 2): per-layer budgets differ."""
    from kvpress import PyramidKVPress

    path, model = llama
    prompt = _prompt(3)
    ratio = 0.5
    mean = int(PROMPT_LEN * (1 - ratio))
    ours = _engine_kept(
        path,
        model,
        prompt,
        sparse_method="pyramidkv",
        sink_keep_tokens=0,
        recent_keep_tokens=8,
        observation_window_size=8,
        decode_keep_tokens=mean - 8,
        score_kernel_size=5,
        score_pooling="avg",
        pyramidkv_beta=2.0,
    )
    theirs = _kvpress_kept(model, prompt, PyramidKVPress(compression_ratio=ratio, window_size=8, kernel_size=5, beta=2))
    assert ours == theirs
    sizes = [len(layer[0]) for layer in ours]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]


def _capture_qk(model, prompt) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer the post-RoPE queries ``[Hq, L, D]`` and keys ``[Hkv, L, D]`` of a dense HF forward."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    captured = {}

    def hook(layer_idx):
        def fn(module, args, kwargs, output):
            hidden = kwargs["hidden_states"]
            cos, sin = kwargs["position_embeddings"]
            shape = (*hidden.shape[:-1], -1, module.head_dim)
            q = module.q_proj(hidden).view(shape).transpose(1, 2)
            k = module.k_proj(hidden).view(shape).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            captured[layer_idx] = (q[0], k[0])

        return fn

    handles = [
        layer.self_attn.register_forward_hook(hook(i), with_kwargs=True) for i, layer in enumerate(model.model.layers)
    ]
    try:
        with torch.no_grad():
            model(torch.tensor([prompt]))
    finally:
        for h in handles:
            h.remove()
    return captured


def _causal_probs(q: torch.Tensor, k: torch.Tensor, first_query: int) -> torch.Tensor:
    """``[Hq, n, L]`` softmax of queries at positions ``first_query..`` over keys, causal, GQA by repetition."""
    g = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(g, dim=0)
    logits = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])
    n, length = q.shape[1], k.shape[1]
    pos = torch.arange(first_query, first_query + n).view(-1, 1)
    logits = logits.masked_fill(torch.arange(length).view(1, -1) > pos, float("-inf"))
    return torch.softmax(logits.float(), dim=-1)


def _snapkv_reference(model, prompt, *, window, kernel, sink, recent, keep) -> list[list[set[int]]]:
    """SnapKV as in its paper's code (max pooling): window queries' attention, summed over the window,
    max-pooled, mean over the GQA group; keep sink + top ``keep`` of the middle + ``recent``."""
    n = len(prompt)
    kept = []
    for q, k in _capture_qk(model, prompt).values():
        probs = _causal_probs(q[:, n - window :], k, n - window)[..., : n - window]  # [Hq, w, n-w]
        pooled = torch.nn.functional.max_pool1d(probs.mean(1, keepdim=True), kernel, 1, kernel // 2)[:, 0]
        g = q.shape[0] // k.shape[0]
        per_kv = pooled.view(k.shape[0], g, -1).mean(1)
        layer_sets = []
        for row in per_kv:
            middle = row[sink : n - recent]
            # Max pooling makes plateaus of equal scores: ties go to the earlier token (our documented rule).
            top = (torch.sort(middle, descending=True, stable=True).indices[:keep] + sink).tolist()
            layer_sets.append(set(range(sink)) | set(top) | set(range(n - recent, n)))
        kept.append(layer_sets)
    return kept


def test_snapkv_our_defaults_match_reference(llama):
    """Our defaults differ from kvpress's: window 32, max pooling with kernel 7, sink tokens kept."""
    path, model = llama
    prompt = _prompt(5)
    ours = _engine_kept(
        path, model, prompt, sparse_method="snapkv", sink_keep_tokens=8, decode_keep_tokens=40, recent_keep_tokens=32
    )
    assert ours == _snapkv_reference(model, prompt, window=32, kernel=7, sink=8, recent=32, keep=40)


def _h2o_reference(model, prompt, heavy: int, recent: int, per_head: bool) -> list[list[set[int]]]:
    """H2O from the paper: accumulate every prompt query's attention per key, keep the top ``heavy`` among
    the non-recent keys plus the ``recent`` last ones. Attention computed here from HF's q and k."""
    captured = _capture_qk(model, prompt)
    kept = []
    n = len(prompt)
    for i in range(len(model.model.layers)):
        q, k = captured[i]  # [Hq, L, D], [Hkv, L, D]
        g = q.shape[0] // k.shape[0]
        acc = _causal_probs(q, k, 0).sum(1)  # [Hq, L]: attention each key received
        per_kv = acc.view(k.shape[0], g, n).sum(1)
        rows = per_kv if per_head else per_kv.sum(0, keepdim=True).expand_as(per_kv)
        layer_sets = []
        for row in rows:
            candidates = row[: n - recent]
            top = torch.topk(candidates, heavy).indices.tolist()
            layer_sets.append(set(top) | set(range(n - recent, n)))
        kept.append(layer_sets)
    return kept


@pytest.mark.parametrize("per_head", [False, True])
def test_h2o_matches_paper_reference(llama, per_head):
    path, model = llama
    prompt = _prompt(4)
    budget, ratio = 80, 0.25
    ours = _engine_kept(
        path,
        model,
        prompt,
        sparse_method="h2o",
        h2o_prefill_budget=budget,
        h2o_recent_ratio=ratio,
        h2o_prefill_score_window=0,  # every prompt query scores, as in the paper
        h2o_per_head=per_head,
    )
    recent = int(budget * ratio)
    assert ours == _h2o_reference(model, prompt, budget - recent, recent, per_head)
