"""Prefix-cache pruning end to end (tiny random Llama, dense): the kept tokens are those a plain HF
computation of ``snapkv_global`` picks, resuming the pruned chain equals HF decoding from a cache with
exactly those tokens removed, and requests that did not ask for pruning keep getting exact KV."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sparse_serve import LLM, PruneError, SamplingParams

BLOCK = 8
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _llm(path, **kw) -> LLM:
    base = dict(device="cpu", dtype="float32", block_size=BLOCK, max_num_batched_tokens=32, max_num_seqs=8)
    return LLM(str(path), **{**base, **kw})


def _hf_kept(model, history: list[int], ranges, window: int, keep: int) -> list[list[int]]:
    """snapkv_global by hand: attention probabilities of the ``window`` queries after each range to the
    range's tokens, summed over queries, heads and layers, max-pooled (kernel 7), top ``keep``."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")  # attention probabilities come out of eager attention only
    try:
        with torch.no_grad():
            att = torch.stack([a[0] for a in model(torch.tensor([history]), output_attentions=True).attentions])
    finally:
        model.set_attn_implementation(previous)  # the checkpoint fixture is shared
    kept = []
    for start, end in ranges:
        scores = att[:, :, end : end + window, start:end].sum((0, 1, 2))
        pooled = F.max_pool1d(scores.view(1, 1, -1), 7, stride=1, padding=3).view(-1)
        kept.append(sorted((torch.sort(pooled, descending=True, stable=True).indices[:keep] + start).tolist()))
    return kept


def _hf_greedy_from_pruned(model, history: list[int], retained: list[int], suffix: list[int], n: int) -> list[int]:
    """HF greedy decoding of ``suffix`` after the history's KV cache with only ``retained`` positions
    kept (positions continue from the history's length)."""
    with torch.no_grad():
        cache = model(torch.tensor([history]), use_cache=True).past_key_values
        idx = torch.tensor(retained)
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[:, :, idx], layer.values[:, :, idx]
        ids, pos, out = torch.tensor([suffix]), torch.arange(len(history), len(history) + len(suffix))[None], []
        for _ in range(n):
            logits = model(ids, past_key_values=cache, position_ids=pos, use_cache=True).logits[0, -1]
            out.append(int(logits.argmax()))
            ids, pos = torch.tensor([[out[-1]]]), pos[:, -1:] + 1
    return out


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matrices: one intra-op thread is several times faster than contending for a loaded box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    return tiny_checkpoint("llama")


def test_pruned_history_matches_hf_and_stays_out_of_the_radix_cache(llama):
    path, model = llama
    llm = _llm(path)
    kv = llm.engine.kv
    history, suffix = _tokens(72, 20), _tokens(11, 21)
    llm.generate(history, SamplingParams(max_tokens=1))  # the history is now in the radix cache (9 full blocks)
    ranges = [(10, 30), (37, 52)]
    result = llm.prune(history, ranges, keep_tokens=5, observation_window_size=6)
    assert result.kept == tuple(tuple(k) for k in _hf_kept(model, history, ranges, 6, 5))
    retained = [p for p in range(72) if not any(a <= p < b for a, b in ranges)] + [p for k in result.kept for p in k]
    retained.sort()
    assert result.num_tokens == 72 and result.num_retained_tokens == len(retained) == 72 - 35 + 10
    info = llm.engine.chain_info(result.chain_id)
    assert info.degraded and not info.busy and info.kv_lens == (len(retained),) * 3

    # The pruned chain holds the cached KV of the retained positions; its rewritten blocks are unnamed.
    table = kv.chains.held_tables()[result.chain_id]
    source = kv.cached_prefix(history).block_ids
    assert table.block_ids[:1] == list(source[:1])  # [0, 10) unchanged: the first block is shared
    pool = llm.engine.runner.kv
    for layer in range(3):
        ours = torch.stack([pool.k[layer][table.slot(i) // BLOCK, table.slot(i) % BLOCK] for i in range(len(retained))])
        theirs = torch.stack([pool.k[layer][source[p // BLOCK], p % BLOCK] for p in retained])
        assert torch.equal(ours, theirs)
    assert all(kv.pool.block_hash(b) is None for b in table.block_ids[1:])

    # Resuming the pruned chain computes only the suffix and equals HF decoding from the pruned cache.
    out = llm.generate(history + suffix, GREEDY, chain_id=result.chain_id)[0]
    assert out.chain_status == "resumed" and out.reused_tokens == 72
    assert list(out.token_ids) == _hf_greedy_from_pruned(model, history, retained, suffix, GREEDY.max_tokens)

    # A request that did not ask for pruning gets the exact cached KV, as a fresh engine would compute.
    plain = llm.generate(history + suffix, GREEDY)[0]
    assert plain.num_cached_tokens == 72
    assert plain.token_ids == _llm(path, enable_prefix_caching=False).generate(history + suffix, GREEDY)[0].token_ids
    assert all(kv.pool.block_hash(b) is None for b in kv.chains.held_tables()[result.chain_id].block_ids[1:])


def test_prune_errors(llama):
    # Each engine-side error is a PruneError naming its case and the request field at fault.
    path, _ = llama
    llm = _llm(path)
    history = _tokens(40, 22)

    def fails(match, code, param, *args, **kwargs):
        with pytest.raises(PruneError, match=match) as e:
            llm.prune(*args, **kwargs)
        assert (e.value.code, e.value.param) == (code, param)

    fails("no cached history", "prune_nothing_cached", "prompt", history, [(2, 10)], keep_tokens=2)
    llm.generate(history, SamplingParams(max_tokens=1))  # caches the history's full blocks
    cached = llm.engine.kv.cached_prefix(history).num_tokens
    fails("outside", "invalid_value", "ranges", history, [(2, 41)], keep_tokens=2)
    longer = history + _tokens(8, 23)  # inside this prompt, past its cached part
    fails("outside", "prune_range_not_cached", "ranges", longer, [(2, cached + 2)], keep_tokens=2)
    fails("overlaps or precedes", "invalid_value", "ranges", history, [(12, 20), (2, 10)], keep_tokens=2)
    fails("at least one token after", "invalid_value", "ranges", history[:32], [(2, 32)], keep_tokens=2)
    fails("unknown prune policy", "invalid_value", "policy", history, [(2, 10)], keep_tokens=2, policy="magic")
    fails("keep_tokens", "invalid_value", "keep_tokens", history, [(2, 10)], keep_tokens=-1)
    fails("window", "invalid_value", "observation_window_size", history, [(2, 10)], 2, observation_window_size=0)
    llm.prune(history, [(2, 10)], keep_tokens=2, chain_id="p")
    with pytest.raises(ValueError, match="already exists"):
        llm.prune(history, [(2, 10)], keep_tokens=2, chain_id="p")
    assert llm.engine.kv.pool.num_used_blocks == len(llm.engine.kv.chains.held_tables()["p"].block_ids)
    snap = _llm(path, sparse_method="snapkv")
    with pytest.raises(PruneError, match="radix") as e:
        snap.prune(history, [(2, 10)], keep_tokens=2)
    assert (e.value.code, e.value.param) == ("prune_unsupported", None)
