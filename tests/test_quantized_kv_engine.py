"""Quantized KV stores end to end on CPU: fp8, KIVI and TurboQuant under continuous batching,
chunked prefill, prefix caching and preemption; memory by real bytes; composition with eviction.

The oracle for the per-token schemes (fp8, TurboQuant) is HF transformers whose attention reads
fake-quantized K/V (quantize then dequantize each token's K and V, per KV head, with the formulas
written here): a token's codes depend only on its own K/V, so the engine's stored-then-read KV
equals the fake-quantized KV of a full forward, whatever the chunking.
"""

from __future__ import annotations

import pytest
import torch
from summary_checks import assert_summarizes
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from sparse_kernels.kv_quant import lloyd_max_codebook, turboquant_rotation
from sparse_serve import LLM, SamplingParams

STORES = {
    "fp8": dict(kv_cache_dtype="fp8"),
    "kivi4": dict(sparse_method="kivi", kivi_bits=4),
    "kivi2": dict(sparse_method="kivi", kivi_bits=2),
    "turboquant3": dict(sparse_method="turboquant", turboquant_bits=3, turboquant_seed=7),
    "turboquant2": dict(kv_cache_dtype="turboquant", turboquant_bits=2),
    # a query-aware method over a quantized store: pages picked from summaries of the dequantized keys
    "quest_fp8": dict(
        kv_cache_dtype="fp8", sparse_method="quest", sink_keep_tokens=16, decode_keep_tokens=32, recent_keep_tokens=16
    ),
    # filter layers' logits and attention over fp8 codes, the next layers' chosen slots read as codes
    "omnikv_fp8": dict(
        kv_cache_dtype="fp8",
        sparse_method="omnikv",
        sink_keep_tokens=16,
        decode_keep_tokens=32,
        recent_keep_tokens=16,
        full_attention_layers="1",  # of the tiny model's three: layer 0 dense, 1 the filter, 2 reads its choice
    ),
    "omnikv_tq3": dict(
        kv_cache_dtype="turboquant",
        turboquant_bits=3,
        sparse_method="omnikv",
        sink_keep_tokens=16,
        decode_keep_tokens=32,
        recent_keep_tokens=16,
        full_attention_layers="1",
    ),  # fmt: skip
    # over KIVI the pages' own key statistics are the summaries, and the incomplete page comes from the tail
    "quest_kivi4": dict(
        kv_cache_dtype="kivi", sparse_method="quest", sink_keep_tokens=16, decode_keep_tokens=32, recent_keep_tokens=16
    ),
}
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _prompts(lengths, seed=0, shared=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(3, 384, (shared,), generator=g).tolist()
    return [base + torch.randint(3, 384, (n,), generator=g).tolist() for n in lengths]


def _llm(path, **kw):
    base = dict(device="cpu", dtype="float32", block_size=16, max_num_batched_tokens=24, max_num_seqs=4)
    return LLM(str(path), **{**base, **kw})


@pytest.fixture(scope="module")
def qwen3(tiny_checkpoint):
    return tiny_checkpoint("qwen3")  # head_dim 32: KIVI pages of 16 tokens and 16-channel value groups


# -- the oracle: HF with fake-quantized K/V --------------------------------------------------------


def _fake_fp8(x: torch.Tensor) -> torch.Tensor:
    s = (x.abs().amax(-1, keepdim=True) / 448.0).clamp_min(1e-12)
    return (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s


def _fake_turboquant(x: torch.Tensor, bits: int, seed: int) -> torch.Tensor:
    r = turboquant_rotation(x.shape[-1], seed)
    levels = lloyd_max_codebook(bits)
    y = x.float() @ r
    s = y.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-30)
    mids = (levels[1:] + levels[:-1]) / 2
    codes = (y / s).unsqueeze(-1).gt(mids).sum(-1)
    return (levels[codes] * s) @ r.T


def _hf_fake_quant_greedy(model, prompt, max_new_tokens, fake):
    """Greedy decoding with a full forward per token whose attention reads ``fake(K)``, ``fake(V)``."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        return sdpa_attention_forward(
            module, query, fake(key).to(key.dtype), fake(value).to(value.dtype), attention_mask, **kwargs
        )

    AttentionInterface.register("fake_quant_kv", attention)
    previous = model.config._attn_implementation
    model.set_attn_implementation("fake_quant_kv")
    try:
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(max_new_tokens):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    finally:
        model.set_attn_implementation(previous)  # the checkpoint fixture is shared
    return ids[len(prompt) :]


@pytest.mark.parametrize(
    ("store", "fake"),
    [
        ("fp8", _fake_fp8),
        ("turboquant3", lambda x: _fake_turboquant(x, 3, 7)),
        ("turboquant2", lambda x: _fake_turboquant(x, 2, 0)),
    ],
)
def test_per_token_stores_equal_hf_with_fake_quantized_kv(qwen3, store, fake):
    path, model = qwen3
    prompts = _prompts([5, 37, 61])
    outs = _llm(path, **STORES[store]).generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        assert list(out.token_ids) == _hf_fake_quant_greedy(model, prompt, GREEDY.max_tokens, fake)


# -- the engine's own invariants -------------------------------------------------------------------


@pytest.mark.parametrize("store", sorted(STORES))
def test_prefix_cache_hits_and_equals_a_cache_off_run(qwen3, store):
    """Shared full pages are reused as codes. One request at a time with page-aligned chunks, so both
    runs cut prefill at the same positions: KIVI's KV depends on where chunks end (a query reads its
    own incomplete page at full precision, a filled page as codes), fp8 and TurboQuant's does not."""
    path, _ = qwen3
    # The prompts share 40 tokens (two full blocks of 16): the later ones hit the cache.
    prompts = _prompts([3, 9, 20], seed=1, shared=40)
    aligned = dict(max_num_seqs=1, max_num_batched_tokens=32)
    off = [
        o.token_ids
        for o in _llm(path, enable_prefix_caching=False, **aligned, **STORES[store]).generate(prompts, GREEDY)
    ]
    llm = _llm(path, enable_prefix_caching=True, **aligned, **STORES[store])
    on = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert on == off
    assert llm.engine.kv.prefix_hit_tokens >= 2 * 32  # the later prompts each reused two full blocks


@pytest.mark.parametrize("store", ["fp8", "kivi4", "turboquant3", "quest_fp8", "quest_kivi4", "omnikv_fp8"])
def test_preemption_recomputes_and_gives_everything_back(qwen3, store):
    """Per-token stores recompute to the same tokens. KIVI recomputes a preempted request's generated
    tokens as prefill chunks, which quantize differently from decode steps (see the prefix-cache test),
    so there only the bookkeeping is asserted: every request completes, blocks and tail rows return."""
    path, _ = qwen3
    prompts = _prompts([30, 45, 18, 50], seed=2)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    roomy = [o.token_ids for o in _llm(path, **STORES[store]).generate(prompts, params)]
    tight = _llm(path, num_kv_blocks=6, enable_prefix_caching=False, **STORES[store])
    got = [o.token_ids for o in tight.generate(prompts, params)]
    assert [len(t) for t in got] == [20] * 4
    if "kivi" not in store:
        assert got == roomy
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.kv.pool.num_used_blocks == 0
    assert tight.engine.runner.tail_rows is None or tight.engine.runner.tail_rows.held() == {}


@pytest.mark.parametrize("store", sorted(STORES))
def test_quantized_output_stays_close_to_dense(qwen3, store):
    """A sanity bound, not an oracle: the first greedy token of each prompt equals dense's for the
    higher-precision stores, and every store produces tokens (no NaN: greedy of NaN logits is token 0)."""
    path, _ = qwen3
    prompts = _prompts([20, 33, 47, 64], seed=3)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    dense = [o.token_ids for o in _llm(path).generate(prompts, params)]
    ours = [o.token_ids for o in _llm(path, **STORES[store]).generate(prompts, params)]
    if store in ("fp8", "kivi4"):
        assert ours == dense
    assert all(t[0] != 0 for t in ours)


@pytest.mark.parametrize("store", sorted(STORES))
def test_pool_bytes_are_the_store_bytes_per_token(qwen3, store):
    path, _ = qwen3
    budget = dict(cpu_kv_cache_gib=0.002, max_num_seqs=64)  # under the CPU cap of 64 full-length requests
    llm = _llm(path, **budget, **STORES[store])
    runner = llm.engine.runner
    kind = runner.store
    layers = runner.model_config.num_hidden_layers
    per_block = kind.bytes_per_block(4) * layers
    tails = runner.num_tail_rows * kind.tail_bytes(4) * layers
    assert runner.kv.nbytes() == runner.num_blocks * per_block + tails
    assert runner.kv_bytes_per_block == per_block
    assert per_block == kind.bytes_per_token(4) * 16 * layers
    # The same budget holds more blocks the smaller a token is (admission packs by real bytes).
    dense = _llm(path, **budget).engine.runner
    assert runner.num_blocks == (int(0.002 * 2**30) - tails) // per_block
    assert runner.num_blocks > dense.num_blocks


# SnapKV at a budget under the prompts (4 sink + 20 + 16 recent), and what it generates over a store
SNAP = dict(
    sparse_method="snapkv", sink_keep_tokens=4, decode_keep_tokens=20, recent_keep_tokens=16, observation_window_size=8
)
SNAP_PROMPTS = _prompts([90, 120, 64], seed=4)
SNAP_PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _snapkv_over(path, **store):
    """SnapKV over ``store`` next to SnapKV over the plain store: ``(plain llm, store llm)``, after checking
    both generate and SnapKV's choice over the store's keys agrees with its choice over exact keys on most
    of the first tokens."""
    plain, quantized = _llm(path, **SNAP), _llm(path, **store, **SNAP)
    a = [o.token_ids for o in plain.generate(SNAP_PROMPTS, SNAP_PARAMS)]
    b = [o.token_ids for o in quantized.generate(SNAP_PROMPTS, SNAP_PARAMS)]
    assert all(len(t) == SNAP_PARAMS.max_tokens for t in b)
    assert sum(x[0] == y[0] for x, y in zip(a, b, strict=True)) >= 2
    return plain, quantized


def test_snapkv_runs_over_fp8_and_frees_its_evicted_blocks(qwen3):
    path, _ = qwen3
    bf16, fp8 = _snapkv_over(path, kv_cache_dtype="fp8")
    assert fp8.engine.kv.pool.num_used_blocks == 0
    # fp32 on CPU: fp8 codes plus a float32 scale per (token, head) are (D + 4) / (4 D) of the bytes
    d = fp8.engine.runner.model_config.head_dim
    assert fp8.engine.runner.kv_bytes_per_block * 4 * d == bf16.engine.runner.kv_bytes_per_block * (d + 4)


@pytest.mark.parametrize(
    "store",
    [dict(kv_cache_dtype="fp8"), dict(kv_cache_dtype="turboquant", turboquant_bits=3), dict(kv_cache_dtype="kivi")],
    ids=["fp8", "tq3", "kivi4"],
)
@pytest.mark.parametrize(
    "method",
    [
        dict(sparse_method="streamingllm", sink_keep_tokens=4, recent_keep_tokens=36, decode_eviction_interval=8),
        dict(sparse_method="h2o", h2o_prefill_budget=40, h2o_decode_budget=24, decode_eviction_interval=6),
        dict(sparse_method="pyramidkv", decode_keep_tokens=36, recent_keep_tokens=8, observation_window_size=8),
    ],
    ids=["streamingllm", "h2o", "pyramidkv"],
)
def test_eviction_methods_compact_quantized_stores(qwen3, store, method):
    """Every eviction family runs over a per-token store: prompts longer than the budget are compressed
    (the request holds fewer slots than its tokens) and all blocks come back."""
    path, _ = qwen3
    llm = _llm(path, **method, **store)
    rid = llm.engine.add_request(
        _prompts([150], seed=6)[0], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    )
    held = []
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        req = llm.engine._requests.get(rid)
        if req is not None and req.num_output_tokens:
            held.append(max(req.kv_lens))
    assert held and max(held) < 150
    assert llm.engine.kv.pool.num_used_blocks == 0


QUEST = {k: v for k, v in STORES["quest_fp8"].items() if k != "kv_cache_dtype"}


def _dequantized_block_keys(kv, block: int) -> torch.Tensor:
    """A block's keys as attention reads them, ``[block_size, H, D]`` (the formulas of the store, here)."""
    if kv.scheme == "fp8":
        return kv.k[block].float() * kv.k_scale[block][..., None].float()
    from sparse_kernels.kv_quant import unpack_codes

    levels = kv.codebook[unpack_codes(kv.k[block], kv.bits, kv.head_dim)]
    return (levels * kv.k_scale[block][..., None].float()) @ kv.rotation.T


@pytest.mark.parametrize(
    "store", [dict(kv_cache_dtype="fp8"), dict(kv_cache_dtype="turboquant", turboquant_bits=3)], ids=["fp8", "tq3"]
)
def test_quest_selects_over_a_quantized_store_from_summaries_of_its_dequantized_keys(qwen3, store):
    """Quest over fp8 / TurboQuant: the store keeps block summaries beside the codes, and after prefill
    chunks and decode steps each held block's summary is the min / max of its dequantized keys over its
    tokens (as outward-rounded int8 codes, Quest's default); a budget above every context reads everything
    (tokens equal the plain store's), a small one reads less (tokens differ somewhere), and both finish with
    every block back."""
    path, _ = qwen3
    prompts = _prompts([40, 90, 130], seed=8)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = _llm(path, **QUEST, **store)
    pool = llm.engine.runner.kv
    assert pool.store.summaries and pool.quantized is not None
    rids = [llm.engine.add_request(p, params) for p in prompts]
    checked = 0
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        for rid in rids:
            req = llm.engine._requests.get(rid)
            if req is None or not req.num_output_tokens:
                continue
            table, kv_len = llm.engine.kv.table(rid).block_ids, max(req.kv_lens)
            for layer in (0, 2):
                kv, (kmin, kmax, kscale) = pool.quantized[layer], pool.summary(layer)
                for i, block in enumerate(table[: -(-kv_len // 16)]):
                    keys = _dequantized_block_keys(kv, block)[: min(16, kv_len - 16 * i)]
                    scale = None if kscale is None else kscale[block]
                    assert_summarizes(kmin[block], kmax[block], scale, keys, atol=1e-6)
                    checked += 1
    assert checked > 100 and llm.engine.kv.pool.num_used_blocks == 0
    assert llm.engine.runner.attention.selective.num_selections > 0
    wide = dict(QUEST, decode_keep_tokens=512)
    plain = [o.token_ids for o in _llm(path, **store).generate(prompts, params)]
    assert [o.token_ids for o in _llm(path, **wide, **store).generate(prompts, params)] == plain
    assert [o.token_ids for o in _llm(path, **QUEST, **store).generate(prompts, params)] != plain


def test_quest_over_kivi_bounds_full_pages_by_their_key_statistics(qwen3, monkeypatch):
    """Quest over a KIVI store keeps no summaries: each full page's per-channel key min and step are its
    bounds. Every selection equals Quest's rule written here over the pages' dequantized keys (bound =
    max over the group of sum_d max(q_d * min_d, q_d * max_d), min / max over the page's tokens; the sink
    and newest pages forced; the best pages in ascending order, ties to the earlier), the incomplete newest
    page is read from the request's tail, a wide budget gives plain KIVI's tokens and every block and tail
    row comes back."""
    from sparse_kernels.kv_quant import unpack_codes
    from sparse_methods.methods.quest import Quest

    path, _ = qwen3
    store = STORES["quest_kivi4"]
    llm = _llm(path, **store)
    pool = llm.engine.runner.kv
    assert not pool.store.summaries and pool.store.page_stat_levels == 15
    original, checked = Quest.select_decode, []

    def checked_select(self, layer, batch):
        chosen = original(self, layer, batch)
        kv = pool.quantized[layer]
        sink, keep, recent = self._pages(16)
        group = batch.query.shape[1] // kv.num_kv_heads
        for row in range(batch.query.shape[0]):
            n, kv_len = int(batch.num_pages[row]), int(batch.kv_lens[row])
            blocks = batch.table_indices[int(batch.table_start[row]) :][:n].tolist()
            for h in range(kv.num_kv_heads):
                bounds = []
                for p, block in enumerate(blocks):
                    if p < sink or p >= n - recent:
                        bounds.append(float("inf"))
                        continue
                    assert (p + 1) * 16 <= kv_len  # only full pages are ranked
                    codes = unpack_codes(kv.k[block, :, h], kv.bits, kv.head_dim).float()  # [16, D]
                    keys = codes * kv.k_scale[block, h].float() + kv.k_min[block, h].float()
                    lo, hi = keys.amin(0), keys.amax(0)
                    q = batch.query[row, h * group : (h + 1) * group].float()
                    bounds.append(float(torch.maximum(q * lo, q * hi).sum(-1).max().bfloat16()))  # as Quest ranks
                order = sorted(range(n), key=lambda p: (-bounds[p], p))[: sink + keep + recent]
                assert chosen[row, h].tolist() == sorted(order)
                checked.append(layer)
        return chosen

    monkeypatch.setattr(Quest, "select_decode", checked_select)
    prompts = _prompts([40, 90, 130], seed=8)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = [o.token_ids for o in llm.generate(prompts, params)]
    assert len(checked) >= 40 and all(len(t) == 12 for t in outs)  # (row, KV head) lists checked
    assert llm.engine.kv.pool.num_used_blocks == 0 and llm.engine.runner.tail_rows.held() == {}
    monkeypatch.setattr(Quest, "select_decode", original)
    plain = [o.token_ids for o in _llm(path, kv_cache_dtype="kivi").generate(prompts, params)]
    wide = dict(store, decode_keep_tokens=512)
    assert [o.token_ids for o in _llm(path, **wide).generate(prompts, params)] == plain
    assert outs != plain


@pytest.mark.parametrize("case", ["omnikv_fp8", "omnikv_tq3"])
def test_omnikv_over_a_per_token_store_scores_every_token_from_its_codes(qwen3, monkeypatch, case):
    """OmniKV over fp8 or TurboQuant: at each filter layer the engine hands the method every row's logits over
    the codes (equal to ``scale * q . k`` over the dequantized keys, written here; TurboQuant's computed in the
    rotated space), the next layers read the chosen slots as codes, and every block comes back. With every
    layer a filter layer nothing is skipped: the decode over the codes that wrote those logits gives the plain
    store's tokens."""
    from sparse_methods.methods.omnikv import OmniKV

    path, _ = qwen3
    store = STORES[case]
    llm = _llm(path, **store)
    pool = llm.engine.runner.kv
    original, checked = OmniKV.select_decode, []

    def checked_select(self, layer, batch):
        if layer in self.filter_layers:
            kv, h = pool.quantized[layer], pool.quantized[layer].num_kv_heads
            group = batch.query.shape[1] // h
            for row in range(batch.query.shape[0]):
                n = int(batch.kv_lens[row])
                blocks = batch.table_indices[int(batch.table_start[row]) :][: -(-n // 16)].tolist()
                keys = torch.cat([_dequantized_block_keys(kv, block) for block in blocks])[:n]
                expected = torch.einsum("hd,nhd->hn", batch.query[row].float(), keys.repeat_interleave(group, 1))
                torch.testing.assert_close(batch.logits[row, :, :n], expected * batch.sm_scale, rtol=1e-4, atol=1e-4)
                probs = torch.exp(batch.logits[row, :, :n] - batch.logit_lse[row, :, None])  # each head's softmax
                torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[0]), rtol=1e-5, atol=1e-5)
                checked.append(layer)
        return original(self, layer, batch)

    monkeypatch.setattr(OmniKV, "select_decode", checked_select)
    prompts = _prompts([40, 90, 130], seed=8)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outs = [o.token_ids for o in llm.generate(prompts, params)]
    assert len(checked) >= 15 and all(len(t) == 10 for t in outs)  # rows over the budget, at the filter layer
    assert llm.engine.runner.attention.selective.num_selections > 0
    assert llm.engine.kv.pool.num_used_blocks == 0
    monkeypatch.setattr(OmniKV, "select_decode", original)
    plain_store = {k: v for k, v in store.items() if k in ("kv_cache_dtype", "turboquant_bits")}
    plain = [o.token_ids for o in _llm(path, **plain_store).generate(prompts, params)]
    layers = llm.engine.runner.model_config.num_hidden_layers
    every = dict(store, full_attention_layers=",".join(map(str, range(layers))))
    assert [o.token_ids for o in _llm(path, **every).generate(prompts, params)] == plain
    assert outs != plain


def test_synthetic_quantized_noise_keeps_block_summaries_true(qwen3):
    """Benchmarks' synthetic prefill over a quantized store with summaries: every block's summary is the
    min / max of its dequantized noise keys (else Quest's page bounds tie and it reads the first pages)."""
    path, _ = qwen3
    runner = _llm(path, num_kv_blocks=40, **STORES["quest_fp8"]).engine.runner
    runner.randomize_kv(seed=3)
    pool = runner.kv
    for layer, kv in enumerate(pool.quantized):
        kmin, kmax, kscale = pool.summary(layer)
        for b in range(pool.num_blocks):
            assert_summarizes(kmin[b], kmax[b], kscale[b], _dequantized_block_keys(kv, b), atol=1e-6)
        assert not torch.equal(kmin, kmax)


def test_snapkv_over_kivi_keeps_its_budget_in_a_quarter_of_the_bytes_and_resumes_chains(qwen3):
    """SnapKV compacts a KIVI store: each layer keeps its budget (the kept tokens re-encoded into full pages plus
    the request's tail row), generation goes on from there, every block and tail row comes back, and a
    block costs KIVI-4's bytes. A chain keeps the compressed KV with the incomplete page's tail (on the host)
    and the next turn resumes from it (``test_chain_cache_engine.py`` checks resumed turns token for token)."""
    path, _ = qwen3
    plain, kivi = _snapkv_over(path, kv_cache_dtype="kivi")
    engine = kivi.engine
    rid = engine.add_request(SNAP_PROMPTS[1], SNAP_PARAMS)
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        req = engine._requests.get(rid)
        if req is not None and req.num_output_tokens:
            held.append(list(req.kv_lens))
    budget = 4 + 20 + 16
    assert held[0] == [budget] * len(held[0])  # compacted at the end of prefill, every layer to its budget
    assert held[-1] == [budget + len(held) - 1] * len(held[0])
    assert engine.kv.pool.num_used_blocks == 0 and engine.runner.tail_rows.num_free == engine.runner.num_tail_rows
    # fp32 on CPU: 4-bit codes (D / 2 bytes per token, K and V) plus fp16 statistics against 4 D bytes
    assert engine.runner.kv_bytes_per_block * 4 < plain.engine.runner.kv_bytes_per_block
    first = kivi.generate(SNAP_PROMPTS[0], SNAP_PARAMS, chain_id="conversation")[0]
    assert first.chain_status == "created" and engine.runner.tail_rows.held() == {}
    follow = SNAP_PROMPTS[0] + list(first.token_ids) + SNAP_PROMPTS[2][:9]
    second = kivi.generate(follow, SNAP_PARAMS, chain_id="conversation")[0]
    assert second.chain_status == "resumed" and second.reused_tokens == len(SNAP_PROMPTS[0]) + 7
    assert len(second.token_ids) == 8 and engine.runner.tail_rows.held() == {}
    kivi.drop_chain("conversation")
    assert engine.kv.pool.num_used_blocks == 0


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (dict(sparse_method="quest", kv_cache_dtype="kivi", block_size=32), "set kv_quant_page_size=16"),
        (dict(sparse_method="quest", block_size=32), "pages of 16 tokens.*set block_size=16"),
        (dict(sparse_method="omnikv", kv_cache_dtype="kivi"), "from keys or history"),
        (dict(sparse_method="retroinfer", kv_cache_dtype="fp8"), "from keys or history"),
        (dict(sparse_method="retroinfer", kv_cache_dtype="turboquant"), "from keys or history"),
        (dict(sparse_method="retroinfer", kv_cache_dtype="kivi"), "from keys or history"),  # KIVI's own statistics
        # bound pages for a method that asks for summaries only
        (dict(sparse_method="kivi", kv_cache_dtype="fp8"), "contradicts"),
        (dict(kivi_bits=2), "applies to kv_cache_dtype='kivi'"),
    ],
)
def test_unsupported_combinations_are_clear_errors(qwen3, config, match):
    path, _ = qwen3
    with pytest.raises(ValueError, match=match):
        _llm(path, **config)


# -- on a GPU: the Triton kernels, CUDA graphs and pipelined decode ------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("store", sorted(STORES))
def test_cuda_graphs_and_pipelining_equal_eager_and_track_the_cpu_reference(qwen3, store):
    """On the GPU (Triton kernels; fp16 tensor-core operands for the dequantized tiles), decode under
    CUDA graphs with pipelined steps gives exactly the eager engine's greedy tokens; against the CPU
    reference path (fp32 throughout) the first token of every prompt agrees."""
    path, _ = qwen3
    prompts = _prompts([5, 37, 61, 100], seed=5)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    cuda = dict(device="cuda", num_kv_blocks=64)  # fixed: the test does not depend on the GPU's free memory
    llm = _llm(path, async_scheduling=True, **cuda, **STORES[store])
    gpu = [o.token_ids for o in llm.generate(prompts, params)]
    assert llm.engine.runner.graphs.num_replays > 0
    assert llm.engine.num_pipelined_steps > 0
    eager = [o.token_ids for o in _llm(path, enforce_eager=True, **cuda, **STORES[store]).generate(prompts, params)]
    assert gpu == eager
    cpu = [o.token_ids for o in _llm(path, **STORES[store]).generate(prompts, params)]
    assert [t[0] for t in gpu] == [t[0] for t in cpu]


def test_fp8_static_scales_from_a_file(qwen3, tmp_path):
    """fp8_kv_scale_path: one k and one v dequant multiplier per layer, written as every token's scale."""
    path, _ = qwen3
    layers = 3
    good = tmp_path / "scales.json"
    good.write_text('{"k": [0.05, 0.05, 0.05], "v": [0.02, 0.02, 0.02]}')
    llm = _llm(path, sparse_method="fp8_kv", fp8_kv_scale_path=str(good))
    out = llm.generate(_prompts([20], seed=7), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 4
    kv = llm.engine.runner.kv.quantized[0]
    written = kv.k_scale.flatten()[kv.k_scale.flatten() != 0]
    assert written.numel() > 0 and torch.allclose(written, torch.tensor(0.05))
    for bad, match in [
        ('{"k": [0.1], "v": [0.1]}', "for a model of 3 layers"),
        ('{"k": 1}', "expected"),
        ('{"k": [0,0,0], "v": [1,1,1]}', "positive"),
    ]:
        f = tmp_path / "bad.json"
        f.write_text(bad)
        with pytest.raises(ValueError, match=match):
            _llm(path, sparse_method="fp8_kv", fp8_kv_scale_path=str(f))
    assert layers == llm.engine.runner.model_config.num_hidden_layers


@pytest.mark.slow
def test_quest_over_fp8_with_every_kernel_interpreted_equals_the_reference_path(qwen3, monkeypatch):
    """The Triton path of Quest over fp8 (quantize-on-write, page bounds and top-k, the head-sparse decode
    over codes) under the interpreter gives the reference path's greedy tokens."""
    path, _ = qwen3
    prompt = _prompts([70], seed=9)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    store = dict(kv_cache_dtype="fp8", **QUEST)
    reference = [o.token_ids for o in _llm(path, **store).generate(prompt, params)]
    monkeypatch.setenv("SPARSE_KERNELS_BACKEND", "triton")
    llm = _llm(path, **store)
    assert [o.token_ids for o in llm.generate(prompt, params)] == reference
    assert llm.engine.runner.attention.selective.num_selections > 0
