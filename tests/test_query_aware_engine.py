"""Quest and OmniKV through the engine on CPU: exact at large budgets, the head-sparse read paths (block
and slot lists) equal dense when they read everything, block summaries always equal a recomputation,
prefix caching and continuous batching on, and each list holds no more than the budget."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from summary_checks import assert_summarizes, fast_args
from tiny_models import DEFAULT_MODEL

from sparse_kernels.summary_codes import decode_summary
from sparse_methods import DecodeRead, LayerPlan, Selection, Unit
from sparse_serve import LLM, SamplingParams

PROMPTS = ["def parse(text):" * 40, "Return the number of" * 30, "class Queue:" * 12, "x = 1\n" * 50]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SMALL = dict(
    sparse_method="quest", sink_keep_tokens=16, decode_keep_tokens=48, recent_keep_tokens=32, quest_skip_layers=1
)
OMNI = dict(sparse_method="omnikv", sink_keep_tokens=8, decode_keep_tokens=40, recent_keep_tokens=24)


def _llm(**kw) -> LLM:
    return LLM(str(DEFAULT_MODEL), **{"device": "cpu", "max_model_len": 1024, "max_num_batched_tokens": 128, **kw})


def _tokens(llm: LLM, prompts=PROMPTS, params=GREEDY):
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _top_ascending(scores: torch.Tensor, sink: int, recent: int, k: int) -> torch.Tensor:
    """``[H, min(k, n)]`` ascending: the first ``sink`` and last ``recent`` columns, then the best (ties: earlier)."""
    scores = scores.clone()
    scores[:, :sink] = scores[:, scores.shape[1] - recent :] = float("inf")
    return torch.sort(torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k], dim=1).values


def quest_reference(method):
    """Quest written from the paper, one query at a time (``_reference_attention``): per KV head, page scores
    = the max over its query heads of sum over channels of max(q*min, q*max); sink, recent and the top pages."""
    c = method.config

    def select(layer, request, view):
        if view.kv_len <= method.budget:
            return None
        page = view.page_size
        hkv, d = view.page_min.shape[1:]
        q = view.query.float().view(hkv, -1, 1, d)  # [Hkv, g, 1, D]
        lo, hi = view.page_min, view.page_max
        if view.page_scale is not None:  # int8 codes: the bounds they stand for
            lo, hi = decode_summary(lo, hi, view.page_scale)
        lo, hi = (s.float().permute(1, 0, 2)[:, None] for s in (lo, hi))  # [Hkv, 1, P, D]
        scores = torch.maximum(q * lo, q * hi).sum(-1).amax(1)  # [Hkv, P]
        scores = scores.bfloat16().float()  # Quest ranks bfloat16 bounds
        sink, recent = -(-c.sink_keep_tokens // page), max(1, -(-c.recent_keep_tokens // page))
        k = sink + c.decode_keep_tokens // page + recent
        return Selection(_top_ascending(scores, sink, recent, k), page)

    return SimpleNamespace(select=select)


def omnikv_reference(method):
    """OmniKV written from the paper, one query at a time (``_reference_attention``): at a filter layer, per
    query head the softmax of q.k * scale over all tokens, the max over heads; sink, recent and the top
    tokens, which the next layers read (``sets``: request -> the last filter layer's set)."""
    c, sets = method.config, {}

    def select(layer, request, view):
        if layer in method.filter_layers:
            sets[request.request_id] = None
            if view.kv_len > method.budget:
                g = view.query.shape[0] // view.keys.shape[1]
                keys = view.keys.float().repeat_interleave(g, dim=1)  # [L, Hq, D]
                logits = torch.einsum("hd,lhd->hl", view.query.float(), keys) * view.keys.shape[-1] ** -0.5
                probs = torch.softmax(logits, dim=-1).amax(0, keepdim=True)
                sets[request.request_id] = _top_ascending(
                    probs, c.sink_keep_tokens, c.recent_keep_tokens, method.budget
                )[0]
            return None
        chosen = sets.get(request.request_id)
        return None if chosen is None else Selection(chosen.expand(method.shape.num_kv_heads, -1), 1)

    return SimpleNamespace(select=select, sets=sets)


def _reference_attention(reference, layer, q, k_cache, v_cache, kmin, kmax, meta, group, scale, kscale=None):
    """``(out, selected)``: the decode rows' attention written plainly, one query at a time: the reference
    sees the query, its pages' key summaries and its keys (``view``) and answers a ``Selection`` (or None:
    every token), and each query head attends over the tokens its KV head selected; ``selected``: the rows
    that did not read everything."""
    bs, hkv, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    group_size, out, selected = q.shape[1] // hkv, torch.empty_like(q), 0
    for i in range(q.shape[0]):
        kv_len = group.kv_lens[i] + 1
        blocks = torch.tensor(group.block_ids[i][: -(-kv_len // bs)], dtype=torch.int64)
        slots = (blocks[:, None] * bs + torch.arange(bs)).flatten()[:kv_len]  # token -> pool slot
        keys, values = k_cache.reshape(-1, hkv, d)[slots], v_cache.reshape(-1, hkv, d)[slots]
        summaries = (kmin[blocks], kmax[blocks]) if kmin is not None else (None, None)
        view = SimpleNamespace(
            query=q[i],
            kv_len=kv_len,
            page_size=bs,
            page_min=summaries[0],
            page_max=summaries[1],
            page_scale=None if kscale is None else kscale[blocks],
        )
        chosen = reference.select(layer, meta.steps[i], SimpleNamespace(**vars(view), keys=keys))
        selected += chosen is not None
        for h in range(hkv):
            if chosen is None:
                tokens = torch.arange(kv_len)
            elif chosen.page_size == 1:
                tokens = chosen.indices[h]
            else:
                tokens = (chosen.indices[h][:, None] * bs + torch.arange(bs)).flatten()
                tokens = tokens[tokens < kv_len]
            heads = slice(h * group_size, (h + 1) * group_size)
            probs = torch.softmax(q[i, heads].float() @ keys[tokens, h].float().T * scale, dim=-1)
            out[i, heads] = (probs @ values[tokens, h].float()).to(q.dtype)
    return out, selected


def _read_everything(monkeypatch, method, unit: Unit) -> None:
    """Make ``method``'s selecting layers select every entry (pages or slots) each row holds, on the device."""
    plan = method.layer_plan

    def every_plan(layer: int) -> LayerPlan:
        p = plan(layer)
        return LayerPlan(DecodeRead.SELECTED, unit=unit) if p.selects_decode else p

    def every_entry(layer, batch):
        per_row = batch.num_pages if unit is Unit.PAGE else batch.kv_lens
        size = int(per_row.max())  # the step's widest row; narrower rows read their own number
        return torch.arange(size).expand(batch.query.shape[0], method.shape.num_kv_heads, size)

    monkeypatch.setattr(method, "layer_plan", every_plan)
    monkeypatch.setattr(method, "selection_size", lambda kv_len, page_size: -(-kv_len // page_size))
    monkeypatch.setattr(method, "select_decode", every_entry)


def _check_summaries(llm: LLM) -> int:
    """Every block a running request holds has min/max summaries of its keys (valid part): equal in the
    model dtype, rounded outward as int8 codes (``summary_checks.assert_summarizes``)."""
    engine, pool, bs = llm.engine, llm.engine.runner.kv, llm.engine.config.block_size
    checked = 0
    for req in engine.scheduler.running:
        block_ids = engine.kv.table(req.request_id).block_ids
        full, rest = divmod(req.kv_len, bs)
        full = min(full, len(block_ids))
        # The full blocks at once, then the partial one (its valid rows).
        parts = [(torch.tensor(block_ids[:full], dtype=torch.long), bs)] if full else []
        if rest and full < len(block_ids):
            parts.append((torch.tensor([block_ids[full]], dtype=torch.long), rest))
        for layer in range(len(pool.k)):
            kmin, kmax, kscale = pool.summary(layer)
            for blocks, valid in parts:
                scale = None if kscale is None else kscale[blocks]
                assert_summarizes(kmin[blocks], kmax[blocks], scale, pool.k[layer][blocks, :valid])
        checked += sum(len(blocks) for blocks, _ in parts)
    return checked


@pytest.mark.parametrize("method", ["quest", "omnikv"])
def test_budget_at_least_context_is_dense(method):
    assert _tokens(_llm(sparse_method=method, decode_keep_tokens=4096)) == _tokens(_llm())


def test_reading_every_page_through_the_sparse_path_equals_dense(monkeypatch):
    """The head-sparse plumbing (per-head page lists, partial newest page last, rows of different widths in
    one step) is exact when it reads all."""
    llm = _llm(**SMALL)
    _read_everything(monkeypatch, llm.engine.method, Unit.PAGE)
    assert _tokens(llm) == _tokens(_llm())
    assert llm.engine.runner.attention.selective.num_selections > 0


def test_small_budget_reads_only_its_pages_with_prefix_caching_and_batching():
    llm = _llm(**SMALL)
    engine = llm.engine
    shared = "import os\nimport sys\n" * 30
    prompts = [shared + p for p in PROMPTS] + PROMPTS
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    pending = list(enumerate(prompts))
    steps_with_checks = 0
    while pending or engine.has_unfinished_requests():
        if pending:
            i, p = pending.pop(0)
            engine.add_request(p, params, request_id=str(i))
        engine.step()
        steps_with_checks += _check_summaries(llm) > 0
    assert steps_with_checks > 5
    assert engine.prefix_hit_tokens > 0  # token-exact KV: the radix cache stays on
    assert engine.kv.pool.num_used_blocks == 0
    selective = engine.runner.attention.selective
    # Contexts of 200-800 tokens, a 96-token budget: every list holds sink 1 + keep 3 + recent 2 pages at most.
    assert selective.num_selections > 0
    assert selective.max_list_pages == 1 + 3 + 2


@settings(max_examples=8, deadline=None)
@given(
    block_size=st.sampled_from([4, 16]),
    chunk=st.integers(8, 96),
    lengths=st.lists(st.integers(5, 200), min_size=1, max_size=3),
    summary_dtype=st.sampled_from(["int8", "model"]),
)
def test_summaries_after_append_equal_recomputation(block_size, chunk, lengths, summary_dtype):
    llm = LLM(
        str(DEFAULT_MODEL),
        device="cpu",
        max_model_len=512,
        block_size=block_size,
        max_num_batched_tokens=chunk,
        sparse_method="quest",
        quest_chunk_size=block_size,
        sink_keep_tokens=block_size,
        decode_keep_tokens=2 * block_size,
        recent_keep_tokens=block_size,
        quest_summary_dtype=summary_dtype,
    )
    engine = llm.engine
    assert engine.runner.kv.store.summary_codes == (summary_dtype == "int8")
    gen = torch.Generator().manual_seed(sum(lengths))
    for n in lengths:
        engine.add_request(
            torch.randint(5, 400, (n,), generator=gen).tolist(), SamplingParams(max_tokens=6, temperature=0)
        )
    while engine.has_unfinished_requests():
        engine.step()
        _check_summaries(llm)


def test_omnikv_reading_every_slot_through_slot_lists_equals_dense(monkeypatch):
    llm = _llm(**OMNI)
    _read_everything(monkeypatch, llm.engine.method, Unit.SLOT)
    assert _tokens(llm) == _tokens(_llm())
    assert llm.engine.runner.attention.selective.num_selections > 0


def test_omnikv_reads_its_budget_after_filter_layers_with_prefix_caching():
    llm = _llm(**OMNI)
    engine = llm.engine
    assert engine.method.filter_layers == [0, 2, 3]  # auto for a 6-layer model
    shared = "import os\nimport sys\n" * 30
    outs = llm.generate([shared + p for p in PROMPTS] + PROMPTS, GREEDY, use_tqdm=False)
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
    assert engine.prefix_hit_tokens > 0
    selective = engine.runner.attention.selective
    assert selective.num_selections > 0
    assert selective.max_list_pages == 8 + 40 + 24  # slot lists hold exactly the budget
    assert engine.kv.pool.num_used_blocks == 0


def test_batched_device_selection_equals_the_paper():
    """The GPU path (pages picked on the device and written into the Triton kernel's index buffer; run
    here under Triton's interpreter) reads the same pages and gives the same attention as Quest written
    from the paper, one query at a time."""
    from sparse_serve.selective_decode import SelectiveDecode
    from sparse_serve.step_metadata import build_step_metadata

    llm = _llm(**SMALL)
    engine = llm.engine
    for i, p in enumerate(PROMPTS[:3]):
        engine.add_request(p, SamplingParams(max_tokens=40, temperature=0.0), request_id=str(i))
    while any(r.num_computed_tokens < r.prefill_len for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    batch = engine.scheduler.schedule()
    meta = build_step_metadata(batch, engine.kv.table, engine.config.block_size)
    attention, pool = engine.runner.attention, engine.runner.kv
    assert meta.num_decode_tokens == 3 and len(meta.groups) == 1
    q = torch.randn(3, 8, 64, generator=torch.Generator().manual_seed(0))
    layer = 3
    args, codes = fast_args(pool, layer)
    assert codes["kscale"] is not None  # Quest's default: int8 codes, bounds from their decoded values
    reference = quest_reference(engine.method)
    expected, selected = _reference_attention(
        reference, layer, q, *args, meta, meta.groups[0], attention.sm_scale, kscale=codes["kscale"]
    )
    fast = SelectiveDecode(torch.device("cpu"), attention.shape, attention.sm_scale, backend="triton")
    fast.plan_step(engine.method, meta, meta.groups[0])
    assert fast.batched
    got = fast.run_batched(engine.method, layer, q, *args, torch.empty_like(q), **codes)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert 1 <= fast.num_selections == selected


@pytest.mark.parametrize("config", [SMALL, OMNI], ids=["quest", "omnikv"])
def test_engine_takes_the_batched_path_when_the_kernels_can(config, monkeypatch):
    """Wiring: on CPU too (the kernels' reference backends), every selecting layer goes through
    ``run_batched``, batches of one included."""
    llm = _llm(**config)
    selective = llm.engine.runner.attention.selective
    calls = {"batched": 0}
    real_batched = selective.run_batched

    def run_batched(*args, **kw):
        calls["batched"] += 1
        return real_batched(*args, **kw)

    monkeypatch.setattr(selective, "run_batched", run_batched)
    llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert calls["batched"] > 0


OMNI_PREFILL = dict(
    sparse_method="omnikv",
    prefill_sparse_method="omnikv_prefill",
    prefill_sink_tokens=4,
    prefill_keep_tokens=32,
    prefill_recent_tokens=16,
    decode_keep_tokens=4096,
)


def test_omnikv_prefill_at_large_budget_is_dense():
    cfg = {**OMNI_PREFILL, "prefill_keep_tokens": 4096}
    assert _tokens(_llm(**cfg, max_num_batched_tokens=64)) == _tokens(_llm(max_num_batched_tokens=64))


def test_omnikv_prefill_reading_the_whole_history_equals_dense(monkeypatch):
    """The slot-list prefill path (history then the chunk, one slot per page) is exact when it reads all."""
    llm = _llm(**OMNI_PREFILL, max_num_batched_tokens=64)

    def whole_history(layer, request, view):
        return Selection(torch.arange(view.history_len).expand(2, view.history_len), 1)

    monkeypatch.setattr(llm.engine.method, "prefill_selection", whole_history)
    assert _tokens(llm) == _tokens(_llm(max_num_batched_tokens=64))
    assert llm.engine.runner.attention.selective_prefill.num_selections > 0


def test_omnikv_prefill_chunks_read_only_their_budget():
    llm = _llm(**OMNI_PREFILL, max_num_batched_tokens=64)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
    selective = llm.engine.runner.attention.selective_prefill
    assert selective.num_selections > 0 and selective.max_history_read == 4 + 32 + 16
    assert llm.engine.kv.pool.num_used_blocks == 0


def _decode_step(llm, prompts, max_tokens=40):
    """A decode-only step's metadata after the prompts' prefill."""
    from sparse_serve.step_metadata import build_step_metadata

    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0.0), request_id=str(i))
    while any(r.num_computed_tokens < r.prefill_len for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    batch = engine.scheduler.schedule()
    return build_step_metadata(batch, engine.kv.table, engine.config.block_size)


def _dense_plan(attention, group, backend):
    from sparse_kernels import BatchDecodeWithPagedKVCache

    dense = BatchDecodeWithPagedKVCache("cpu", backend=backend)
    dense.plan(
        group.decode_kv_indptr,
        group.decode_kv_indices,
        group.decode_kv_last_len,
        sm_scale=attention.sm_scale,
        **attention.shape,
    )
    return dense


@pytest.mark.parametrize(
    ("pad", "kernels", "backend"),
    [(0, "auto", "reference"), (0, "auto", "triton"), (2, "auto", "triton"), (2, "triton", "triton")],
)
def test_omnikv_device_set_equals_the_paper(pad, kernels, backend, monkeypatch):
    """OmniKV's batched path (the filter layer's logits through the tables, attention from them, the
    set scored and picked on the device; the next layer reads it through slot lists; Triton under the
    interpreter, or the reference kernels) equals OmniKV written from the paper one query at a time,
    with a CUDA graph's padding rows beside the requests; with ``triton`` kernels the method's own
    kernels (head max probabilities, ascending top-k) are Triton too."""
    from sparse_serve.cuda_graphs import pad_decode_metadata
    from sparse_serve.selective_decode import SelectiveDecode

    llm = _llm(sparse_method="omnikv", sink_keep_tokens=4, decode_keep_tokens=20, recent_keep_tokens=8)
    meta = _decode_step(llm, PROMPTS[:3])
    engine, attention, pool = llm.engine, llm.engine.runner.attention, llm.engine.runner.kv
    method = engine.method
    filt = method.filter_layers[0]
    gen = torch.Generator().manual_seed(1)
    q_filter, q_next = (torch.randn(3, 8, 64, generator=gen) for _ in range(2))
    group = meta.groups[0]
    reference = omnikv_reference(method)
    expected = []  # the filter layer's output (all tokens), then the next layer's (the set)
    for layer, q in ((filt, q_filter), (filt + 1, q_next)):
        args = (pool.k[layer], pool.v[layer], None, None)
        expected.append(_reference_attention(reference, layer, q, *args, meta, group, attention.sm_scale)[0])
    padded = pad_decode_metadata(meta, 3 + pad) if pad else meta
    monkeypatch.setenv("SPARSE_KERNELS_BACKEND", kernels)
    fast = SelectiveDecode(torch.device("cpu"), attention.shape, attention.sm_scale, backend=backend)
    fast.plan_step(method, padded, padded.groups[0])
    assert fast.batched and fast.graph_key() is not None  # every row selects: graph-eligible
    # Planned again (a next step of the same layout): the head-sparse plan stays, the table is read in
    # place from the caller's device buffer (the dense plan's, with spare capacity).
    table = torch.cat([padded.groups[0].decode_kv_indices, torch.full((7,), -1, dtype=torch.int32)])
    kept = fast._planned
    fast.plan_step(method, padded, padded.groups[0], table=table)
    assert fast._table is table and fast._planned is kept
    dense = _dense_plan(attention, padded.groups[0], backend)
    for (layer, q), want in zip(((filt, q_filter), (filt + 1, q_next)), expected, strict=True):
        q = torch.cat([q, torch.zeros(pad, *q.shape[1:])])
        args = (pool.k[layer], pool.v[layer], None, None)
        got = fast.run_batched(method, layer, q, *args, torch.empty_like(q), dense=dense)
        torch.testing.assert_close(got[:3], want, rtol=1e-5, atol=1e-5)
    host_sets = [reference.sets[str(i)].tolist() for i in range(3)]
    assert method._device_set[:3].tolist() == host_sets


@pytest.mark.parametrize(("kernels", "summary_dtype"), [("auto", "int8"), ("triton", "int8"), ("triton", "model")])
def test_quest_uniform_step_with_padding_rows_equals_the_paper(kernels, summary_dtype, monkeypatch):
    """Quest's batched path on a step where every request selects (the CUDA-graph case), plus padding
    rows, equals Quest written from the paper one query at a time (over the bounds the summaries stand
    for: int8 codes decoded, or the model dtype's min / max); with ``triton`` the method's kernels (page
    bounds, ascending top-k) run under the interpreter."""
    from sparse_serve.cuda_graphs import pad_decode_metadata
    from sparse_serve.selective_decode import SelectiveDecode

    llm = _llm(
        sparse_method="quest",
        sink_keep_tokens=16,
        decode_keep_tokens=32,
        recent_keep_tokens=16,
        quest_summary_dtype=summary_dtype,
    )
    meta = _decode_step(llm, [PROMPTS[0], PROMPTS[1], PROMPTS[3]])
    engine, attention, pool = llm.engine, llm.engine.runner.attention, llm.engine.runner.kv
    q = torch.randn(3, 8, 64, generator=torch.Generator().manual_seed(0))
    layer = 3
    args, codes = fast_args(pool, layer)
    reference = quest_reference(engine.method)
    expected, selected = _reference_attention(
        reference, layer, q, *args, meta, meta.groups[0], attention.sm_scale, kscale=codes["kscale"]
    )
    assert selected == 3
    padded = pad_decode_metadata(meta, 5)
    monkeypatch.setenv("SPARSE_KERNELS_BACKEND", kernels)
    fast = SelectiveDecode(torch.device("cpu"), attention.shape, attention.sm_scale, backend="triton")
    fast.plan_step(engine.method, padded, padded.groups[0])
    assert fast.graph_key() is not None
    q5 = torch.cat([q, torch.randn(2, 8, 64)])
    got = fast.run_batched(engine.method, layer, q5, *args, torch.empty_like(q5), **codes)
    torch.testing.assert_close(got[:3], expected, rtol=1e-5, atol=1e-5)


def test_synthetic_kv_noise_keeps_block_summaries_true():
    """Benchmarks' synthetic prefill (``randomize_kv``) fills K with noise; Quest's block summaries must
    bound the noise, or its page bounds tie and it reads the first pages whatever the query."""
    llm = _llm(**SMALL, num_kv_blocks=64)
    runner = llm.engine.runner
    runner.randomize_kv(seed=3)
    for layer, k in enumerate(runner.kv.k):
        kmin, kmax, kscale = runner.kv.summary(layer)
        for block in range(k.shape[0]):
            assert_summarizes(kmin[block], kmax[block], kscale[block], k[block])
        assert not torch.equal(kmin, kmax)


@pytest.mark.parametrize(
    ("config", "reference"),
    [
        (
            dict(sparse_method="quest", sink_keep_tokens=16, decode_keep_tokens=32, recent_keep_tokens=16),
            quest_reference,
        ),
        (
            dict(sparse_method="omnikv", sink_keep_tokens=4, decode_keep_tokens=60, recent_keep_tokens=8),
            omnikv_reference,
        ),
    ],
    ids=["quest", "omnikv"],
)
def test_mixed_step_on_cpu_kernels_equals_the_paper(config, reference):
    """A step where one request fits its budget (reads everything: block lists, or slot lists for
    OmniKV) beside one that selects, on the reference kernels (the CPU engine's path): equal to the
    method written from the paper one query at a time, layer after layer."""
    from sparse_serve.selective_decode import SelectiveDecode

    llm = _llm(**config)
    meta = _decode_step(llm, [PROMPTS[0], PROMPTS[2]])  # 200 and 60 prompt tokens
    attention, pool, method = llm.engine.runner.attention, llm.engine.runner.kv, llm.engine.method
    group = meta.groups[0]
    ref, selected = reference(method), 0
    fast = SelectiveDecode(torch.device("cpu"), attention.shape, attention.sm_scale, backend="reference")
    fast.plan_step(method, meta, group)
    assert fast.batched and fast.graph_key() is None  # rows read different sizes: not graph-eligible
    dense = _dense_plan(attention, group, "reference")
    gen = torch.Generator().manual_seed(2)
    for layer in range(4):  # OmniKV: filter layers 0, 2 and 3
        q = torch.randn(2, 8, 64, generator=gen)
        codes = pool.summary(layer) or (None, None, None)
        args = (pool.k[layer], pool.v[layer])
        want, chosen = _reference_attention(
            ref, layer, q, *args, *codes[:2], meta, group, attention.sm_scale, kscale=codes[2]
        )
        got = fast.run_batched(method, layer, q, *args, *codes[:2], torch.empty_like(q), dense=dense, kscale=codes[2])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        selected += chosen
    assert selected > 0 and fast.num_selections > 0
