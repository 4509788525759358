"""AdaKV (per-head adaptive budgets over SnapKV scores) on CPU with tiny random models: kept sets after
a prefill equal kvpress's AdaKVPress(SnapKVPress) configured the same way; each head attends only to
its own tokens during decode (greedy tokens equal a plain per-head-masked decode written here); a
budget above the context is dense; the head-major store holds the sum of the heads' counts (each
(layer, KV head) lane ceil(kept / block_size) blocks), so AdaKV admits as many requests as SnapKV."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_method_oracles import PROMPT_LEN, _dense_keys, _positions, _prompt
from test_methods_engine import _admitted
from transformers import DynamicCache

from sparse_methods import ModelShape, build_method
from sparse_methods.methods.adakv import adaptive_keep
from sparse_serve import LLM, SamplingParams
from sparse_serve.bench.decode import _step_kv_tokens, _step_kv_tokens_reference, max_batch_size
from sparse_serve.step_metadata import table_slots


def _kvpress_adakv_kept(model, prompt, ratio, window, alpha) -> list[list[set[int]]]:
    from kvpress import AdaKVPress, SnapKVPress

    press = AdaKVPress(SnapKVPress(compression_ratio=ratio, window_size=window, kernel_size=5), alpha_safeguard=alpha)
    with torch.no_grad(), press(model):
        model(torch.tensor([prompt]), past_key_values=DynamicCache())
    return masked_kept(model, len(prompt))


def masked_kept(model, n: int) -> list[list[set[int]]]:
    """Per (layer, KV head) the prompt tokens a kvpress masking press left unmasked (it clears the masks)."""
    kept = []
    for layer in model.model.layers:
        _, heads, seqs = layer.self_attn.masked_key_indices
        sets = [set(range(n)) for _ in range(model.config.num_key_value_heads)]
        for h, t in zip(heads.tolist(), seqs.tolist(), strict=True):
            sets[h].discard(t)
        layer.self_attn.masked_key_indices = None
        kept.append(sets)
    return kept


def _llm(path, **params) -> LLM:
    return LLM(
        str(path),
        **{
            "device": "cpu",
            "dtype": "float32",
            "block_size": 16,
            "max_num_batched_tokens": 4096,
            "sparse_method": "adakv",
            **params,
        },
    )


def _engine_kept(llm, model, prompt) -> list[list[set[int]]]:
    return _engine_kept_on(llm.engine, model, prompt)


def _engine_kept_on(engine, model, prompt) -> list[list[set[int]]]:
    """Prefill in one step, then per (layer, head) the tokens the head holds."""
    rid = engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0.0))
    engine.step()
    kept = head_kept(engine, rid, model, prompt)
    engine.abort_request(rid)
    return kept


def head_kept(engine, rid, model, prompt) -> list[list[set[int]]]:
    """Per (layer, KV head) the prompt tokens the head's lane holds in the engine's head-major store;
    the memory in use is the sum over lanes of ceil(kept / block_size) blocks."""
    req = engine.scheduler.running[0]
    layout, bs = engine.kv.layout, engine.config.block_size
    dense = _dense_keys(model, prompt)
    kept = []
    for layer in range(layout.num_layers):
        flat = engine.runner.kv.k[layer].view(-1, engine.runner.kv.k[layer].shape[-1])  # one head per slot
        lanes = [table_slots(engine.kv.table(rid, t).block_ids, req.kv_lens[t], bs) for t in layout.lanes(layer)]
        kept.append([_positions(flat[slots].cpu(), dense[layer][h]) for h, slots in enumerate(lanes)])
    planned = sum(-(-len(s) // bs) for layer in kept for s in layer)
    assert engine.kv.num_held_blocks(rid) == engine.kv.pool.num_used_blocks == planned  # tails given back
    return kept


def _kvpress_params(n_kept: int, window: int, alpha: float) -> dict:
    return dict(
        sink_keep_tokens=0,
        recent_keep_tokens=window,
        observation_window_size=window,
        decode_keep_tokens=n_kept - window,
        score_kernel_size=5,
        score_pooling="avg",
        score_gqa_reduce="mean",
        alpha_safeguard=alpha,
    )


@pytest.mark.parametrize(("ratio", "window", "alpha"), [(0.5, 64, 0.2), (0.7, 16, 0.5)])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_adakv_matches_kvpress(tiny_checkpoint, family, ratio, window, alpha):
    path, model = tiny_checkpoint(family)
    prompt = _prompt(4)
    n_kept = int(PROMPT_LEN * (1 - ratio))
    ours = _engine_kept(_llm(path, **_kvpress_params(n_kept, window, alpha)), model, prompt)
    assert ours == _kvpress_adakv_kept(model, prompt, ratio, window, alpha)
    # Budgets really are per head (ragged) and sum to H x budget per layer.
    sizes = [[len(s) for s in layer] for layer in ours]
    assert all(sum(layer) == len(layer) * n_kept for layer in sizes)
    assert any(len(set(layer)) > 1 for layer in sizes)


def _masked_decode_reference(model, prompt, kept, steps) -> list[int]:
    """Greedy decode of an HF model whose head ``h`` of layer ``l`` sees only prompt tokens ``kept[l][h]``
    (plus every generated token): a boolean per-head mask over a dense cache."""
    from transformers import DynamicCache

    n = len(prompt)
    cache = DynamicCache()
    ids = torch.tensor([prompt])
    out = []
    with torch.no_grad():
        logits = model(ids, past_key_values=cache).logits[0, -1]
        g = model.config.num_attention_heads // model.config.num_key_value_heads
        for _ in range(steps):
            tok = int(logits.argmax())
            out.append(tok)
            length = cache.get_seq_length() + 1
            masks = []
            for sets in kept:
                m = torch.zeros(model.config.num_key_value_heads, length, dtype=torch.bool)
                for h, s in enumerate(sets):
                    m[h, sorted(s)] = True
                m[:, n:] = True
                masks.append(m.repeat_interleave(g, 0))
            logits = _run_masked(model, tok, cache, masks)
    return out


def _run_masked(model, tok, cache, masks):
    """One decode step where layer ``l``'s query head ``h`` attends to ``masks[l][h]`` only."""
    handles = []
    for layer, attn in enumerate(model.model.layers):
        mask = torch.where(masks[layer], 0.0, float("-inf"))[None, :, None, :]  # [1, Hq, 1, L]

        def pre(module, args, kwargs, mask=mask):
            kwargs["attention_mask"] = mask
            return args, kwargs

        handles.append(attn.self_attn.register_forward_pre_hook(pre, with_kwargs=True))
    try:
        impl = model.config._attn_implementation
        model.config._attn_implementation = "eager"
        return model(torch.tensor([[tok]]), past_key_values=cache).logits[0, -1]
    finally:
        model.config._attn_implementation = impl
        for h in handles:
            h.remove()


def test_adakv_decode_reads_each_heads_own_tokens(tiny_checkpoint):
    path, model = tiny_checkpoint("llama")
    prompt = _prompt(5)
    params = _kvpress_params(60, 16, 0.2)
    kept = _engine_kept(_llm(path, **params), model, prompt)
    out = _llm(path, **params).generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert list(out.token_ids) == _masked_decode_reference(model, prompt, kept, 8)
    union = [[set().union(*layer)] * len(layer) for layer in kept]  # fillers visible: other tokens
    assert list(out.token_ids) != _masked_decode_reference(model, prompt, union, 8)


def test_head_major_prefill_runs_the_lanes_in_one_paged_launch(tiny_checkpoint):
    """A head-major store's prefill rows are (request, KV head) lanes: no cascade split (a fused call per lane)."""
    attention = _llm(tiny_checkpoint("llama")[0], **_kvpress_params(60, 16, 0.2)).engine.runner.attention
    assert attention.lanes > 1
    assert attention._new_plan(None, 0).prefill.cascade is False


def test_adakv_budget_above_context_is_dense(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen3")
    prompt = _prompt(6, 90)
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    dense = LLM(str(path), device="cpu", dtype="float32", max_num_batched_tokens=4096).generate([prompt], greedy)[0]
    ours = _llm(path, sink_keep_tokens=4, decode_keep_tokens=80, recent_keep_tokens=32).generate([prompt], greedy)[0]
    assert ours.token_ids == dense.token_ids


@settings(max_examples=40, deadline=None)
@given(
    heads=st.integers(1, 4),
    kv_len=st.integers(8, 60),
    budget=st.integers(2, 40),
    sink=st.integers(0, 3),
    recent=st.integers(1, 6),
    alpha=st.sampled_from([0.0, 0.2, 0.5, 1.0]),
    seed=st.integers(0, 1000),
)
def test_adaptive_keep_properties(heads, kv_len, budget, sink, recent, alpha, seed):
    """Each head keeps its protected slots and its safeguard; the layer keeps H x budget; each row leads
    with its own kept slots, ascending, padded to the largest head; the plan's average is the budget."""
    budget = max(budget, sink + recent)
    if kv_len <= budget:
        return
    scores = torch.rand(heads, kv_len, generator=torch.Generator().manual_seed(seed))
    keep, counts = adaptive_keep(scores, kv_len=kv_len, sink=sink, recent=recent, budget=budget, alpha=alpha)
    assert sum(counts) == heads * budget
    assert max(counts) == keep.shape[1]
    floor = max(sink + recent, max(1, int(budget * alpha)) if alpha else 0)
    assert min(counts) >= min(floor, budget)
    for h in range(heads):
        own = keep[h, : counts[h]]
        assert bool((own.diff() > 0).all())
        assert set(range(sink)) | set(range(kv_len - recent, kv_len)) <= set(own.tolist())
    method = build_method(
        "adakv",
        ModelShape(1, heads, heads, 4),
        sink_keep_tokens=sink,
        recent_keep_tokens=recent,
        observation_window_size=1,
        decode_keep_tokens=budget - sink - recent,
        alpha_safeguard=alpha,
    )
    assert method.memory_plan(kv_len, 0, kv_len).resident_tokens == (budget,)  # per head, on average


def test_adakv_admits_at_least_as_many_as_snapkv(tiny_checkpoint):
    """The same pool and budget: the head-major store holds the sum of the heads' counts, so AdaKV packs
    as many synthetic requests (each lane holding the planned per-head budget) as SnapKV; a real prompt's
    ragged layers take the sum over lanes of ceil(kept / block_size) blocks, fewer than the largest head
    times the heads that a store without lanes held."""
    path, model = tiny_checkpoint("llama")
    params = _kvpress_params(48, 16, 0.2)
    counts, planned, bs = {}, {}, 16
    for name in ("snapkv", "adakv"):
        own = params if name == "adakv" else {k: v for k, v in params.items() if k != "alpha_safeguard"}
        engine = _llm(path, num_kv_blocks=60, max_num_seqs=64, **own, sparse_method=name).engine
        planned[name] = max_batch_size(engine, 300, 1, "synthetic")  # what the benchmark adds (one token more)
        counts[name] = _admitted(engine, 300)
        lanes = engine.kv.layout.num_tables if name == "adakv" else 1
        assert engine.kv.pool.num_used_blocks == counts[name] * lanes * -(-48 // bs)
        # The benchmark's bytes read per step count layer slots (every head), from per-lane lengths here.
        assert _step_kv_tokens(engine) == _step_kv_tokens_reference(engine) == (counts[name] * 3 * 48, counts[name])
    assert counts["adakv"] >= counts["snapkv"] == 60 // 3
    assert planned["adakv"] >= planned["snapkv"] == 60 // 4
    engine = _llm(path, **params).engine
    kept = _engine_kept_on(engine, model, _prompt(4))
    largest = sum(len(layer) * -(-max(map(len, layer)) // bs) for layer in kept)
    assert sum(-(-len(s) // bs) for layer in kept for s in layer) < largest


def test_adakv_batches_equal_requests_alone(tiny_checkpoint):
    """Prompts in one batch, prefilled in chunks beside other requests' decodes (a row per (request, KV
    head) in every kernel, prefill rows gathered into lane order), generate what each does alone."""
    path, _ = tiny_checkpoint("qwen3")
    params = dict(_kvpress_params(40, 8, 0.2), max_num_batched_tokens=64)
    prompts = [_prompt(seed, n) for seed, n in ((1, 90), (2, 130), (3, 61))]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    together = [o.token_ids for o in _llm(path, **params).generate(prompts, greedy)]
    assert together == [_llm(path, **params).generate([p], greedy)[0].token_ids for p in prompts]


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.integers(8, 50), min_size=1, max_size=4),
    budget=st.integers(6, 30),
    alpha=st.sampled_from([0.0, 0.2, 1.0]),
    seed=st.integers(0, 1000),
)
def test_adaptive_keep_over_ragged_heads(lens, budget, alpha, seed):
    """Heads that already hold different counts (a resumed chain): each keeps only its own slots, its own
    sink and recent ones, and the layer keeps H x budget of them; uniform lengths give the uniform answer."""
    sink, recent = 2, 3
    scores = torch.rand(len(lens), max(lens), generator=torch.Generator().manual_seed(seed))
    keep, counts = adaptive_keep(scores, kv_len=lens, sink=sink, recent=recent, budget=budget, alpha=alpha)
    assert sum(counts) == min(len(lens) * budget, sum(lens))
    for h, n in enumerate(lens):
        own = keep[h, : counts[h]].tolist()
        assert own == sorted(set(own)) and all(0 <= i < n for i in own)
        assert set(range(sink)) | set(range(n - recent, n)) <= set(own)
    uniform = adaptive_keep(scores, kv_len=max(lens), sink=sink, recent=recent, budget=budget, alpha=alpha)
    ragged = adaptive_keep(scores, kv_len=[max(lens)] * len(lens), sink=sink, recent=recent, budget=budget, alpha=alpha)
    assert torch.equal(uniform[0], ragged[0]) and uniform[1] == ragged[1]


def test_padded_head_major_decode_equals_the_unpadded_one(tiny_checkpoint):
    """A CUDA graph's step on CPU: a ragged head-major decode padded to a bucket (a dummy row per KV head
    of each padded request) gives the real rows' hidden states unchanged; a capture's all-padding step runs."""
    from sparse_serve.cuda_graphs import _dummy_decode_metadata, pad_decode_metadata
    from sparse_serve.step_metadata import build_step_metadata

    path, _ = tiny_checkpoint("qwen3")
    engine = _llm(path, **_kvpress_params(40, 8, 0.2)).engine
    for seed, n in ((1, 90), (2, 75)):
        engine.add_request(_prompt(seed, n), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.prefill_len for r in engine.scheduler.running):
        engine.step()
    meta = build_step_metadata(engine.scheduler.schedule(), engine.kv.table, 16, layout=engine.kv.layout)
    runner = engine.runner
    assert meta.groups[0].heads > 1 and meta.num_prefill_requests == 0

    def hidden(m):
        runner.attention.plan(m)
        return runner.model(m.input_ids, m.positions, runner.attention)

    with torch.inference_mode():
        want = hidden(meta)
        torch.testing.assert_close(hidden(pad_decode_metadata(meta, 5))[:2], want, rtol=1e-5, atol=1e-5)
        assert hidden(_dummy_decode_metadata(3, meta.layer_group, meta.groups[0].heads)).shape[0] == 3
