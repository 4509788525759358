"""Methods over shards of the KV heads (tensor parallelism without processes): two instances, each given
half the KV heads and their query groups and a ``HeadReduction`` that combines them through threads,
keep exactly the slots that one instance over every head keeps for those heads, and choose the same
prefill history (H2O's shared score, TOVA's head mean, AdaKV's shared-out places,
KVzip's ranking of every head, OmniKV's max over heads). The engine-level twin, over gloo ranks, is
tests/test_tensor_parallel_engine.py."""

from __future__ import annotations

import threading

import pytest
import torch

import sparse_methods as sm
from sparse_methods.attention_batch import LayerAttentionBatch
from sparse_methods.base import HeadReduction, LayerAttention, PrefillView, RequestStep, StepContext

FULL = sm.ModelShape(num_layers=2, num_q_heads=8, num_kv_heads=4, head_dim=8)
SHARDS = 2
SCALE = 0.3
PROMPT, DECODE, CHUNK = 40, 6, 16


class ThreadShards(HeadReduction):
    """Shard ``shard`` of ``SHARDS``, each run in its own thread: an operation waits for every shard's
    input, then combines them in shard order."""

    def __init__(self, shard: int, barrier: threading.Barrier, slots: list) -> None:
        self.num_shards, self.shard, self._barrier, self._slots = SHARDS, shard, barrier, slots

    def _all(self, x: torch.Tensor) -> list[torch.Tensor]:
        self._slots[self.shard] = x
        self._barrier.wait()
        parts = list(self._slots)
        self._barrier.wait()  # everyone has read before a later call writes
        return parts

    def sum(self, x):
        return torch.stack(self._all(x)).sum(0)

    def max(self, x):
        return torch.stack(self._all(x)).amax(0)

    def gather(self, x, dim):
        return torch.cat(self._all(x), dim=dim)

    def local(self, x, dim):
        n = x.shape[dim] // self.num_shards
        return x.narrow(dim, self.shard * n, n)


def _shard_shape() -> sm.ModelShape:
    return sm.ModelShape(FULL.num_layers, FULL.num_q_heads // SHARDS, FULL.num_kv_heads // SHARDS, FULL.head_dim)


def _data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per layer, per token: queries ``[layers, T, Hq, D]`` and keys ``[layers, T, Hkv, D]``."""
    g = torch.Generator().manual_seed(seed)
    n = PROMPT + DECODE + 32  # room for replay tokens
    return (
        torch.randn(FULL.num_layers, n, FULL.num_q_heads, FULL.head_dim, generator=g),
        torch.randn(FULL.num_layers, n, FULL.num_kv_heads, FULL.head_dim, generator=g),
    )


def _heads(shard: int | None) -> tuple[slice, slice]:
    """Query and KV heads of ``shard`` (None: every head)."""
    if shard is None:
        return slice(None), slice(None)
    q, kv = FULL.num_q_heads // SHARDS, FULL.num_kv_heads // SHARDS
    return slice(shard * q, (shard + 1) * q), slice(shard * kv, (shard + 1) * kv)


def _drive(method, shard: int | None, data) -> list[torch.Tensor]:
    """A request through chunked prefill, the method's replay passes and one-token decode steps; its
    held tokens per layer ``[heads, n]`` (token ids) at the end."""
    queries, keys = data
    qh, kvh = _heads(shard)
    heads = method.shape.num_kv_heads
    held = [torch.empty(heads, 0, dtype=torch.long) for _ in range(FULL.num_layers)]

    def step(r: RequestStep, tokens: torch.Tensor) -> None:  # tokens: the step's token ids into ``data``
        nonlocal held
        observed = method.prepare_step(StepContext((r,)))
        ahead = [torch.cat([h, tokens.expand(heads, -1)], dim=1) for h in held]
        for layer in range(FULL.num_layers):
            if r.request_id in observed:
                k = keys[layer][:, kvh][ahead[layer].T, torch.arange(heads)]  # [kv_len, heads, D]
                view = LayerAttention(queries[layer][tokens][:, qh], k, SCALE)
                method.on_attention_end(layer, LayerAttentionBatch.of_views((r,), [view]))
        if r.replay is None:
            held = ahead
        compaction = method.finish_step().get(r.request_id)
        for layer, keep in enumerate(compaction.keep if compaction else ()):
            if keep is not None:
                held[layer] = held[layer].gather(1, keep)

    done = 0
    while done < PROMPT:
        n = min(CHUNK, PROMPT - done)
        step(RequestStep("r", done, n, PROMPT, tuple(h.shape[1] for h in held)), torch.arange(done, done + n))
        done += n
    prompt_ids = list(range(3, 3 + PROMPT))
    for i, p in enumerate(method.replay_passes("r", prompt_ids)):
        m = sum(len(x) if isinstance(x, tuple) else 3 for x in p.parts)  # text stands for 3 tokens
        r = RequestStep("r", PROMPT, m, PROMPT, tuple(h.shape[1] for h in held), replay=i)
        step(r, torch.arange(PROMPT, PROMPT + m) % queries.shape[1])
    for t in range(PROMPT, PROMPT + DECODE):
        step(RequestStep("r", t, 1, PROMPT, tuple(h.shape[1] for h in held)), torch.tensor([t]))
    return held


def _sharded(name: str, run, **params):
    """``run(method, shard)`` for one instance over every head, then for ``SHARDS`` instances in threads."""
    whole = run(sm.build_method(name, FULL, **params), None)
    barrier, slots = threading.Barrier(SHARDS), [None] * SHARDS
    methods = [sm.build_method(name, _shard_shape(), **params) for _ in range(SHARDS)]
    results = [None] * SHARDS

    def shard_run(i: int) -> None:
        methods[i].head_reduction = ThreadShards(i, barrier, slots)
        results[i] = run(methods[i], i)

    threads = [threading.Thread(target=shard_run, args=(i,)) for i in range(SHARDS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(r is not None for r in results), "a shard failed"
    return whole, results, methods


EVICTING = {
    "h2o": dict(h2o_prefill_budget=12, h2o_decode_budget=10, decode_eviction_interval=3),
    "tova": dict(decode_keep_tokens=8),
    "adakv": dict(sink_keep_tokens=2, decode_keep_tokens=6, recent_keep_tokens=4, observation_window_size=4),
    "kvzip": dict(kvzip_token_budget=8, kvzip_score_chunk_size=16, kvzip_prev_postfix_size=4, sink_keep_tokens=2),
}


@pytest.mark.parametrize("name", EVICTING)
def test_shards_keep_what_one_instance_keeps(name):
    data = _data()
    whole, shards, methods = _sharded(name, lambda m, s: (_drive(m, s, data), m), **EVICTING[name])
    held, full = whole
    assert held[0].shape[1] < PROMPT  # the method evicted
    for shard, (part, method) in enumerate(shards):
        _, kvh = _heads(shard)
        for layer in range(FULL.num_layers):
            assert torch.equal(part[layer], held[layer][kvh])
            assert method.layer_plan(layer) == full.layer_plan(layer)


def test_shards_pick_omnikvs_prefill_history():
    queries, keys = _data(1)
    params = dict(
        prefill_sparse_method="omnikv_prefill",
        full_attention_layers="0",
        prefill_sink_tokens=2,
        prefill_keep_tokens=5,
        prefill_recent_tokens=3,
    )
    r = RequestStep("r", 30, 8, 38, (30, 30))

    def run(method, shard):
        qh, kvh = _heads(shard)
        view = PrefillView(queries[0, 30:38, qh], 30, keys[0, :30, kvh])
        assert method.prefill_selection(0, r, view) is None  # the filter layer reads everything
        return method.prefill_selection(1, r, PrefillView(queries[1, 30:38, qh], 30)).indices

    whole, shards, _ = _sharded("omnikv", run, **params)
    assert whole.shape[1] == 10
    for shard, part in enumerate(shards):
        assert torch.equal(part, whole[_heads(shard)[1]])
