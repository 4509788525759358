"""``prefill_sparse_method="flashprefill_v2"`` end to end on CPU (tiny Llama, small blocks so that short
prompts have many query tiles and key blocks): threshold 0 gives dense's tokens, with and without a
prefix-cache hit and under SnapKV and Quest; a positive threshold attends to exactly the blocks its
selection kept (checked against a plain masked attention), and equals dense where nothing was dropped."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sparse_kernels import causal_attention
from sparse_kernels.block_sparse_prefill import BatchBlockSparsePrefillWithPagedKVCache
from sparse_serve import LLM, SamplingParams
from sparse_serve.config import EngineConfig

BLOCK = 8
SMALL_BLOCKS = dict(
    prefill_sparse_method="flashprefill_v2",
    flashprefill_v2_k_block_m=16,
    flashprefill_v2_k_block_n=16,
    flashprefill_v2_attention_sink_blocks=1,
    flashprefill_v2_window_blocks=1,
    flashprefill_v2_last_query_blocks=1,
    flashprefill_v2_min_sparse_q_len=16,
)
METHODS = {
    "dense": {},
    "snapkv": dict(
        sparse_method="snapkv",
        sink_keep_tokens=4,
        decode_keep_tokens=40,
        recent_keep_tokens=16,
        observation_window_size=8,
    ),
    "quest": dict(
        sparse_method="quest", sink_keep_tokens=8, decode_keep_tokens=48, recent_keep_tokens=16, block_size=16
    ),
}


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 384, (n,), generator=g).tolist() for n in lengths]


def _generate(path, prompts, max_tokens=6, **kw):
    base = dict(device="cpu", dtype="float32", block_size=BLOCK, max_num_batched_tokens=64, max_num_seqs=4)
    llm = LLM(str(path), **{**base, **kw})  # a method's own block_size wins
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    return tiny_checkpoint("llama")[0]


@pytest.fixture
def sparse_runs(monkeypatch):
    """Every block-sparse run of the test (sparse steps only), as it ran: the wrapper's params, step plan,
    tile layout and selection, and copies of q, the caches and the output."""
    runs = []
    run = BatchBlockSparsePrefillWithPagedKVCache.run

    def recording(self, q, k_cache, v_cache, out=None):
        result = run(self, q, k_cache, v_cache, out)
        if self.layout is not None:
            lists = self.select(q, k_cache, v_cache)[2]
            copies = (q.clone(), k_cache.clone(), v_cache.clone(), result.clone())
            runs.append((self.params, self._plan, self.layout, lists, *copies))
        return result

    monkeypatch.setattr(BatchBlockSparsePrefillWithPagedKVCache, "run", recording)
    return runs


@pytest.mark.parametrize("method", METHODS)
def test_threshold_zero_gives_dense_tokens(llama, sparse_runs, method):
    prompts = _prompts([150, 90, 12])  # chunked (64 per step), a cached prefix from the second chunk on
    dense = _generate(llama, prompts, **METHODS[method])
    sparse = _generate(llama, prompts, **METHODS[method], **SMALL_BLOCKS, flashprefill_v2_abs_threshold=0.0)
    assert sparse == dense
    assert sparse_runs, "no step ran block-sparse"
    assert any(
        max(np - nq for np, nq in zip(layout.kv_lens, layout.qo_lens, strict=True)) > 0
        for _, _, layout, *_ in sparse_runs
    )


@pytest.mark.parametrize("method", ["snapkv", "quest"])
def test_positive_threshold_composes_with_the_method(llama, sparse_runs, method):
    prompts = _prompts([150, 90])
    tokens = _generate(llama, prompts, **METHODS[method], **SMALL_BLOCKS, flashprefill_v2_abs_threshold=0.5)
    assert [len(t) for t in tokens] == [6, 6]
    assert any(int(lists.mean_counts.sum()) > 0 for _, _, _, lists, *_ in sparse_runs)  # blocks were dropped


def test_prefix_cache_hit_runs_block_sparse_over_the_suffix(llama, sparse_runs):
    shared = _prompts([96])[0]
    prompts = [shared + tail for tail in _prompts([40, 50], seed=1)]
    kw = dict(max_num_batched_tokens=256, enable_prefix_caching=True)
    llm = LLM(
        str(llama),
        device="cpu",
        dtype="float32",
        block_size=BLOCK,
        **kw,
        **SMALL_BLOCKS,
        flashprefill_v2_abs_threshold=0.0,
    )
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first = llm.generate(prompts[:1], params)[0].token_ids
    second_out = llm.generate(prompts[1:], params)[0]
    second = second_out.token_ids
    assert second_out.num_cached_tokens >= 96 - BLOCK
    assert [first, second] == _generate(
        llama, prompts, max_tokens=4, enable_prefix_caching=False, max_num_batched_tokens=256
    )
    hit = sparse_runs[-1][2]
    assert hit.kv_lens[0] - hit.qo_lens[0] >= 96 - BLOCK  # the second prompt's queries are its suffix


def _masked_attention(plan, layout, lists, q, k_cache, v_cache) -> torch.Tensor:
    """Each query attends causally to the tokens of its tile's kept blocks: plain torch, row by row."""
    p, g = layout.params, layout.group
    out = torch.empty_like(q)
    for b, (start, q_len, kv_len) in enumerate(zip(layout.qo_starts, layout.qo_lens, layout.kv_lens, strict=True)):
        blocks = plan.host_kv_indices[int(plan.host_kv_indptr[b]) : int(plan.host_kv_indptr[b + 1])].long()
        pos = torch.arange(kv_len)
        slots = blocks[pos // plan.block_size] * plan.block_size + pos % plan.block_size
        k, v = k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots]
        for i in range(q_len):
            for hq in range(q.shape[1]):
                h, tile = hq // g, layout.tile_starts[b] + (i * g + hq % g) // p.k_block_m
                kept = lists.keep_ids[h, tile, : lists.keep_counts[h, tile]].long()
                tokens = (kept[:, None] * p.k_block_n + torch.arange(p.k_block_n)).flatten()
                tokens = tokens[tokens <= kv_len - q_len + i]
                row = q[start + i, hq][None, None]
                out[start + i, hq] = causal_attention(row, k[tokens, h][:, None], v[tokens, h][:, None], causal=False)[
                    0, 0
                ]
    return out


def test_positive_threshold_reads_exactly_the_kept_blocks(llama, sparse_runs):
    """The engine's output is attention over the kept blocks; a tile that dropped nothing equals dense."""
    kw = dict(SMALL_BLOCKS, flashprefill_v2_abs_threshold=1.0, flashprefill_v2_use_mean_correction=False)
    _generate(llama, _prompts([150, 70]), max_tokens=2, **kw)
    dropped = 0
    for params, plan, layout, lists, q, k_cache, v_cache, out in sparse_runs[:6]:  # the first layers' runs
        torch.testing.assert_close(out, _masked_attention(plan, layout, lists, q, k_cache, v_cache))
        dense = BatchBlockSparsePrefillWithPagedKVCache(params=dataclasses.replace(params, abs_threshold=0.0))
        layout_args = dict(num_qo_heads=plan.num_qo_heads, num_kv_heads=plan.num_kv_heads, head_dim=plan.head_dim)
        dense.plan(
            plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.kv_last_len, **layout_args, block_size=plan.block_size
        )
        same = lists.keep_counts == dense.select(q, k_cache, v_cache)[2].keep_counts  # [Hkv, tiles]
        dropped += int((~same).sum())
        expected = dense.run(q, k_cache, v_cache)
        for h, t in same.nonzero().tolist():
            b = layout.tile_req[t]
            rows = torch.arange(16) + (t - layout.tile_starts[b]) * 16
            rows = rows[rows < layout.qo_lens[b] * layout.group]
            pos, hq = layout.qo_starts[b] + rows // layout.group, h * layout.group + rows % layout.group
            torch.testing.assert_close(out[pos, hq], expected[pos, hq])
    assert dropped > 0


def test_config_fields_and_store_checks(llama):
    config = EngineConfig(model=str(llama), prefill_sparse_method="flashprefill_v2", sparse_method="h2o")
    assert config.method_config().prefill_sparse_method is None  # h2o's own prefill variant is not chosen
    with pytest.raises(ValueError, match="flashprefill_v2_k_block_n"):
        EngineConfig(model=str(llama), prefill_sparse_method="flashprefill_v2", flashprefill_v2_k_block_n=100)
    with pytest.raises(ValueError, match="not chosen"):
        EngineConfig(model=str(llama), flashprefill_v2_abs_threshold=0.1)
    with pytest.raises(ValueError, match="plain KV store"):
        LLM(str(llama), device="cpu", dtype="float32", kv_cache_dtype="fp8", prefill_sparse_method="flashprefill_v2")
