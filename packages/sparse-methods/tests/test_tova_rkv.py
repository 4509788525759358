"""TOVA and R-KV on the eviction base, driven with random tensors: each compaction keeps exactly what a
plain implementation of the paper's scoring written here keeps (kvpress's TOVAPress is the engine-level
oracle, in tests/); the prompt, the intervals, the plan, chain state and the identity."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import sparse_methods as sm
from sparse_methods.attention_batch import LayerAttentionBatch
from sparse_methods.base import LayerAttention, RequestStep, StepContext
from sparse_methods.methods.rkv import rkv_redundancy

SHAPE = sm.ModelShape(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=8)
SCALE = 0.3


def _keys(n: int, seed: int = 0) -> list[torch.Tensor]:
    """Per layer ``[n, Hkv, D]``; every fourth key a near-copy of an earlier one (redundancy to find)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(SHAPE.num_layers):
        k = torch.randn(n, SHAPE.num_kv_heads, SHAPE.head_dim, generator=g)
        src = torch.randint(0, n, (n,), generator=g)
        near = (torch.arange(n) % 4 == 3) & (src < torch.arange(n))
        k[near] = k[src[near]] + 0.3 * torch.randn(int(near.sum()), SHAPE.num_kv_heads, SHAPE.head_dim, generator=g)
        out.append(k)
    return out


def _drive(
    method, keys, prompt_len, num_decode, *, chunk=64, rid="r", held=None, on_compaction=None, seed=0, resumed=None
):
    """One request through chunked prefill and one-token decode steps, from ``held`` (per layer ``[Hkv, n]``
    token indices of its slots). ``on_compaction(layer, queries, keys, keep)`` sees every compaction with
    the layer's queries so far (``[t, Hq, D]``, one per token) and its keys ``[kv_len, Hkv, D]`` before it.
    ``resumed``: the chain state its first step brings (``RequestStep.resumed_state``)."""
    g = torch.Generator().manual_seed(seed)
    if held is None:
        held = [torch.empty(SHAPE.num_kv_heads, 0, dtype=torch.long) for _ in range(SHAPE.num_layers)]
    done = int(held[0].max()) + 1 if held[0].numel() else 0
    queries = [torch.randn(done, SHAPE.num_q_heads, SHAPE.head_dim, generator=g) for _ in range(SHAPE.num_layers)]
    while done < prompt_len + num_decode:
        n = min(chunk, prompt_len - done) if done < prompt_len else 1
        step = RequestStep(rid, done, n, prompt_len, tuple(h.shape[1] for h in held), resumed_state=resumed)
        resumed = None  # the first step only
        observed = method.prepare_step(StepContext((step,)))
        new = torch.arange(done, done + n).expand(SHAPE.num_kv_heads, -1)
        held = [torch.cat([h, new], dim=1) for h in held]
        views = []
        for layer in range(SHAPE.num_layers):
            queries[layer] = torch.cat([queries[layer], torch.randn(n, SHAPE.num_q_heads, SHAPE.head_dim, generator=g)])
            layer_keys = keys[layer][held[layer].T, torch.arange(SHAPE.num_kv_heads)]  # [kv_len, Hkv, D]
            views.append(layer_keys)
            if rid in observed:
                view = LayerAttention(queries[layer][-n:], layer_keys, SCALE)
                method.on_attention_end(layer, LayerAttentionBatch.of_views((step,), [view]))
        for layer, keep in enumerate(method.finish_step().get(rid, sm.Compaction((None,) * SHAPE.num_layers)).keep):
            if keep is not None:
                if on_compaction is not None:
                    on_compaction(layer, queries[layer], views[layer], keep)
                held[layer] = held[layer].gather(1, keep)
        done += n
    return held


# -- TOVA ------------------------------------------------------------------------------------------


def _tova_reference(query: torch.Tensor, keys: torch.Tensor, budget: int) -> list[int]:
    """TOVA from the paper: the last query's attention averaged over every head; keep the newest token (the
    query's own, as kvpress does) and the top ``budget - 1`` others."""
    k = keys.repeat_interleave(SHAPE.num_q_heads // SHAPE.num_kv_heads, dim=1)  # [L, Hq, D]
    probs = torch.softmax(torch.einsum("hd,lhd->hl", query, k) * SCALE, dim=-1)  # [Hq, L]
    return sorted(torch.topk(probs.mean(0)[:-1], budget - 1).indices.tolist()) + [keys.shape[0] - 1]


def test_tova_keeps_the_last_querys_favourites_at_every_step():
    budget = 12
    method = sm.build_method("tova", SHAPE, decode_keep_tokens=budget - 1, recent_keep_tokens=1)
    checked = []

    def check(layer, queries, keys, keep):
        assert torch.equal(keep[0], keep[1])  # one set per layer
        assert keep[0].tolist() == _tova_reference(queries[-1], keys, budget)
        checked.append(keys.shape[0])

    held = _drive(method, _keys(60), 40, 20, chunk=16, on_compaction=check)
    # after each chunk (16 -> 12, 28 -> 12, 20 -> 12) and then every generated token (13 -> 12)
    assert checked == [16] * 2 + [28] * 2 + [20] * 2 + [13] * 40
    assert all(h.shape[1] == budget for h in held)


# -- R-KV ------------------------------------------------------------------------------------------


def _rkv_reference(queries, keys, *, budget, window, alpha, kernel) -> list[list[int]]:
    """R-KV from its paper's code, one KV head at a time: importance (the window queries' attention to the
    earlier keys, max over the query group before the softmax, mean over queries, max-pooled) minus
    redundancy (cosine similarity between keys, diagonal and each row's last near-copy zeroed, mean over
    rows, softmax); keep the top ``budget - window`` plus the window."""
    num_keys = keys.shape[0]
    g = SHAPE.num_q_heads // SHAPE.num_kv_heads
    scored = num_keys - window
    kept = []
    for h in range(SHAPE.num_kv_heads):
        q = queries[-window:, h * g : (h + 1) * g]  # [W, g, D]
        logits = torch.einsum("wgd,ld->gwl", q, keys[:, h]) * SCALE
        probs = torch.softmax(logits.amax(0)[:, :scored], dim=-1).mean(0)
        importance = F.max_pool1d(probs[None, None], kernel, 1, kernel // 2)[0, 0]
        unit = keys[:, h] / (keys[:, h].norm(dim=-1, keepdim=True) + 1e-8)
        sim = unit @ unit.T
        sim.fill_diagonal_(0.0)
        for i in range(num_keys):
            similar = (sim[i] > 0.5).nonzero()
            sim[i, int(similar.max()) if len(similar) else 0] = 0.0
        redundancy = torch.softmax(sim.mean(0), dim=-1)[:scored]
        score = alpha * importance - (1 - alpha) * redundancy
        top = torch.topk(score, budget - window).indices.tolist()
        kept.append(sorted(top) + list(range(scored, num_keys)))
    return kept


@pytest.mark.parametrize("alpha", [0.1, 0.6])
def test_rkv_keeps_what_the_papers_scoring_keeps(alpha):
    params = dict(sink_keep_tokens=4, decode_keep_tokens=10, recent_keep_tokens=6, rkv_observation_tokens=4)
    method = sm.build_method("rkv", SHAPE, rkv_compression_interval=8, rkv_alpha=alpha, rkv_kernel_size=3, **params)
    plan = method.memory_plan(30, 40, 64)
    assert plan.resident_tokens == (30, 30) and plan.decode_peak_tokens == (38, 38)
    checked = []

    def check(layer, queries, keys, keep):
        ref = _rkv_reference(queries, keys, budget=20, window=4, alpha=alpha, kernel=3)
        assert keep.tolist() == ref
        checked.append(keys.shape[0])

    held = _drive(method, _keys(70, seed=3), 30, 40, chunk=16, on_compaction=check)
    # the prompt stays whole; every 8 generated tokens the cache is cut back to 20
    assert checked == [38, 38, 28, 28, 28, 28, 28, 28, 28, 28]
    assert all(h.shape[1] == 20 + 40 % 8 for h in held)
    assert any(not torch.equal(h[0], h[1]) for h in held)  # per KV head


def test_rkv_never_compresses_the_prompt_and_observes_no_prefill():
    method = sm.build_method("rkv", SHAPE, sink_keep_tokens=0, decode_keep_tokens=16, recent_keep_tokens=0)
    step = RequestStep("r", 0, 100, 100, (0, 0))
    assert not method.prepare_step(StepContext((step,)))
    assert method.finish_step() == {}
    plan = method.memory_plan(1000, 300, 256)
    assert plan.prefill_peak_tokens == plan.resident_tokens == (1000, 1000)
    assert plan.decode_peak_tokens == (1000 + 128, 1000 + 128)


def test_redundancy_tiles_equal_one_tile():
    keys = _keys(97, seed=4)[0]
    whole = rkv_redundancy(keys, max_elements=1 << 30)
    for elements in (1, 2 * 97 * 5, 2 * 97 * 40):
        torch.testing.assert_close(rkv_redundancy(keys, max_elements=elements), whole)


@pytest.mark.parametrize(
    ("params", "match"),
    [
        (dict(rkv_observation_tokens=16, rkv_compression_interval=8), "<= rkv_compression_interval"),
        (dict(sink_keep_tokens=0, decode_keep_tokens=4, recent_keep_tokens=4), "must exceed"),
        (dict(rkv_kernel_size=4), "odd"),
        (dict(rkv_alpha=1.5), "less than or equal"),
        (dict(decode_eviction_interval=4), "has no parameter"),
    ],
)
def test_rkv_bad_parameters_are_errors(params, match):
    with pytest.raises(ValueError, match=match):
        sm.make_config("rkv", **params)


def test_defaults():
    rkv = sm.make_config("rkv")
    assert (rkv.rkv_compression_interval, rkv.rkv_observation_tokens, rkv.rkv_alpha, rkv.rkv_kernel_size) == (
        128,
        8,
        0.1,
        7,
    )
    assert (rkv.sink_keep_tokens, rkv.decode_keep_tokens, rkv.recent_keep_tokens, rkv.rkv_score_chunk_mb) == (
        64,
        4096,
        512,
        512,
    )
    tova = sm.make_config("tova")
    assert (tova.sink_keep_tokens, tova.decode_keep_tokens, tova.recent_keep_tokens) == (0, 4096, 1)
    assert tova.decode_eviction_interval == 1
    for name in ("tova", "rkv"):
        cls = sm.get_method_class(name)
        assert cls.category is sm.Category.PHYSICAL_EVICTION and cls.prefix_cache_mode is sm.PrefixCacheMode.CHAIN


@pytest.mark.parametrize("name", ["tova", "rkv"])
def test_chain_state_resumes_like_one_session(name):
    params = dict(sink_keep_tokens=2, decode_keep_tokens=6, recent_keep_tokens=4)
    params.update(
        dict(decode_eviction_interval=3)
        if name == "tova"
        else dict(rkv_compression_interval=3, rkv_observation_tokens=3)
    )
    keys = _keys(90, seed=5)
    one, session = (sm.build_method(name, SHAPE, **params) for _ in range(2))
    held = _drive(one, keys, 30, 7, chunk=8)
    assert all(torch.equal(a, b) for a, b in zip(_drive(session, keys, 30, 7, chunk=8), held, strict=True))
    state = one.release("r")
    expected = _drive(session, keys, 45, 8, chunk=8, held=held, seed=1)
    for _ in range(2):
        other = sm.build_method(name, SHAPE, **params)
        resumed = _drive(other, keys, 45, 8, chunk=8, rid="s", held=held, seed=1, resumed=state)
        assert all(torch.equal(a, b) for a, b in zip(resumed, expected, strict=True))


@pytest.mark.parametrize("name", ["tova", "rkv"])
def test_budget_above_context_is_the_identity(name):
    interval = dict(decode_eviction_interval=1) if name == "tova" else dict(rkv_compression_interval=8)
    held = _drive(sm.build_method(name, SHAPE, decode_keep_tokens=200, **interval), _keys(80), 60, 20, chunk=16)
    assert all(h.tolist() == [list(range(80))] * SHAPE.num_kv_heads for h in held)
