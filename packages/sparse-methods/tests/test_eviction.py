"""The eviction base: a toy method that is a config plus ``score()`` gets top-k with sink / recent
protection, per-head or shared selection, a memory plan it keeps, decode-time intervals and chain
state from the base; StreamingLLM asks for no attention inputs at all."""

from __future__ import annotations

import pytest
import torch
from pydantic import Field

import sparse_methods as sm
from sparse_methods.attention_batch import LayerAttentionBatch
from sparse_methods.base import LayerAttention, MethodConfig, RequestStep, StepContext
from sparse_methods.eviction import EvictionMethod, Phase, ScoreInputs

SHAPE = sm.ModelShape(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=8)


class KeyNormConfig(MethodConfig):
    sink_keep_tokens: int = Field(2, ge=0)
    decode_keep_tokens: int = Field(6, ge=0)
    recent_keep_tokens: int = Field(4, ge=1)
    decode_eviction_interval: int = Field(3, ge=0)
    shared: bool = False


class KeyNorm(EvictionMethod):
    """Keep the keys of smallest norm (the whole method: config, budgets, score)."""

    name = "test_keynorm"
    Config = KeyNormConfig

    def budgets(self, prompt_len: int, phase: Phase) -> tuple[int, ...] | None:
        c = self.config
        return None if phase is Phase.CHUNK else (c.sink_keep_tokens + c.decode_keep_tokens + c.recent_keep_tokens,) * 2

    @property
    def observation_window(self) -> int:
        return 1

    def score(self, layer: int, inputs: ScoreInputs) -> torch.Tensor:
        scores = -inputs.keys.float().norm(dim=-1).T  # [num_kv_heads, kv_len]
        return scores.sum(0, keepdim=True) if self.config.shared else scores


def _drive(method, keys, prompt_len, chunk, num_decode, rid="r", on_step=None, held=None, tagged=False, resumed=None):
    """Run one request (its keys per layer ``[n, Hkv, D]`` in arrival order) through chunked prefill and
    decode, from ``held`` (per layer ``[Hkv, n]`` arrival indices of the slots it holds, None: nothing);
    returns what each layer holds at the end. Tokens before ``held``'s newest one are processed.
    ``tagged``: each query's last channel is its token's arrival index. ``resumed``: the chain state its
    first step brings (``RequestStep.resumed_state``)."""
    total = prompt_len + num_decode
    if held is None:
        held = [torch.empty(SHAPE.num_kv_heads, 0, dtype=torch.long) for _ in range(SHAPE.num_layers)]
    done = int(held[0].max()) + 1 if held[0].numel() else 0
    while done < total:
        n = min(chunk, prompt_len - done) if done < prompt_len else 1
        step = RequestStep(rid, done, n, prompt_len, tuple(h.shape[1] for h in held), resumed_state=resumed)
        resumed = None  # the first step only
        observed = method.prepare_step(StepContext((step,)))
        new = torch.arange(done, done + n).expand(SHAPE.num_kv_heads, -1)
        held = [torch.cat([h, new], dim=1) for h in held]
        for layer in range(SHAPE.num_layers):
            if rid in observed:
                layer_keys = keys[layer][held[layer].T, torch.arange(SHAPE.num_kv_heads)]  # [kv_len, Hkv, D]
                queries = torch.randn(n, SHAPE.num_q_heads, SHAPE.head_dim)
                if tagged:
                    queries[..., -1] = torch.arange(done, done + n, dtype=queries.dtype)[:, None]
                method.on_attention_end(
                    layer, LayerAttentionBatch.of_views((step,), [LayerAttention(queries, layer_keys, 0.3)])
                )
        for layer, keep in enumerate(method.finish_step().get(rid, sm.Compaction((None,) * 2)).keep):
            if keep is not None:
                held[layer] = held[layer].gather(1, keep)
        done += n
        if on_step is not None:
            on_step(step, held)
    return held


def _keys(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, SHAPE.num_kv_heads, SHAPE.head_dim, generator=g) for _ in range(SHAPE.num_layers)]


@pytest.mark.parametrize("shared", [False, True])
def test_kept_tokens_are_sink_recent_and_the_best_scores(shared):
    method = KeyNorm(KeyNormConfig(decode_eviction_interval=0, shared=shared), SHAPE)
    keys = _keys(40)
    held = _drive(method, keys, 40, chunk=16, num_decode=0)
    for layer in range(SHAPE.num_layers):
        norms = keys[layer].norm(dim=-1).T  # [Hkv, 40]
        rows = norms.sum(0, keepdim=True).expand_as(norms) if shared else norms
        for head in range(SHAPE.num_kv_heads):
            best = torch.argsort(rows[head, 2:36], stable=True)[:6] + 2
            assert set(held[layer][head].tolist()) == {0, 1, *best.tolist(), 36, 37, 38, 39}
        if shared:
            assert torch.equal(held[layer][0], held[layer][1])


def test_memory_follows_the_plan_and_decode_evicts_every_interval():
    method = KeyNorm(KeyNormConfig(), SHAPE)
    plan = method.memory_plan(30, 10, 8)
    lens = []

    def check(step, held):
        lens.append(held[0].shape[1])
        peak = plan.prefill_peak_tokens if step.end < 30 else plan.decode_peak_tokens
        assert all(h.shape[1] <= p for h, p in zip(held, peak, strict=True))

    _drive(method, _keys(40), 30, chunk=8, num_decode=10, on_step=check)
    # compacted at the prompt's end, then every 3 generated tokens
    assert lens == [8, 16, 24, 12, 13, 14, 12, 13, 14, 12, 13, 14, 12, 13]


@pytest.mark.parametrize("name", ["keynorm", "snapkv", "h2o"])
def test_chain_state_resumes_like_one_session(name):
    """A turn's snapshot brought by the next turn's first step (another instance) continues exactly as
    one request that never ended, twice (a snapshot may be resumed more than once)."""
    params = dict(sink_keep_tokens=2, decode_keep_tokens=6, recent_keep_tokens=4, decode_eviction_interval=3)
    if name == "snapkv":
        params["observation_window_size"] = 4
    if name == "h2o":
        params = dict(h2o_prefill_budget=12, h2o_decode_budget=10, decode_eviction_interval=3, h2o_per_head=True)

    def build():
        return KeyNorm(KeyNormConfig(), SHAPE) if name == "keynorm" else sm.build_method(name, SHAPE, **params)

    keys = _keys(80, seed=1)
    one, session = build(), build()
    for method in (one, session):
        torch.manual_seed(0)
        held = _drive(method, keys, 30, chunk=8, num_decode=5)  # turn 1: 30 prompt tokens, 5 generated
    state = one.release("r")
    torch.manual_seed(1)
    expected = _drive(session, keys, 38, chunk=8, num_decode=7, held=held)  # turn 2 of the same request
    for _ in range(2):
        torch.manual_seed(1)
        resumed = _drive(build(), keys, 38, chunk=8, num_decode=7, rid="s", held=held, resumed=state)
        assert all(torch.equal(a, b) for a, b in zip(resumed, expected, strict=True))
    assert one.release("r") is None


@pytest.mark.parametrize(
    ("name", "params", "expected"),
    [
        ("snapkv", dict(observation_window_size=4, decode_eviction_interval=3), sm.DeviceState(query_window=4)),
        ("snapkv", dict(observation_window_size=4, decode_eviction_interval=0), sm.DeviceState()),
        ("streamingllm", dict(decode_eviction_interval=3), sm.DeviceState()),  # ranks nothing: no queries
        ("h2o", dict(h2o_prefill_budget=12, h2o_decode_budget=10, decode_eviction_interval=3), (16, 1)),
        (
            "h2o",
            dict(h2o_prefill_budget=12, h2o_decode_budget=20, decode_eviction_interval=3, h2o_per_head=True),
            (24, 2),
        ),
        ("h2o", dict(h2o_prefill_budget=12, h2o_decode_budget=10, decode_eviction_interval=0), sm.DeviceState()),
    ],
)
def test_device_state_is_asked_of_decode_time_eviction_only(name, params, expected):
    """One declaration of the device buffers: a window scorer that evicts while decoding wants a query ring
    of its window, an accumulating one running sums of its largest budget plus an interval and one token
    (one row summed over the heads, or one per KV head); nothing without decode-time eviction."""
    expected = sm.DeviceState(score_sums=expected) if isinstance(expected, tuple) else expected
    assert sm.build_method(name, SHAPE, **params).device_state() == expected
    with pytest.raises(ValueError, match="query_window"):
        sm.DeviceState(query_window=-1)
    with pytest.raises(ValueError, match="positive"):
        sm.DeviceState(score_sums=(0, 1))


@pytest.mark.parametrize("name", ["streamingllm", "snapkv", "pyramidkv", "h2o"])
def test_budget_above_context_is_the_identity(name):
    method = sm.build_method(name, SHAPE, decode_eviction_interval=4)
    held = _drive(method, _keys(80), 60, chunk=16, num_decode=20)
    assert all(h.tolist() == [list(range(80))] * SHAPE.num_kv_heads for h in held)


def test_streamingllm_asks_for_no_attention_inputs():
    """Its kept set depends on positions only: no step observes attention (decode stays graph-eligible)."""
    method = sm.build_method(
        "streamingllm", SHAPE, sink_keep_tokens=2, recent_keep_tokens=6, decode_eviction_interval=4
    )

    observed, prepare = [], method.prepare_step
    method.prepare_step = lambda step: observed.append(prepare(step)) or observed[-1]
    held = _drive(method, _keys(40), 30, chunk=8, num_decode=10)
    assert len(observed) == 4 + 10 and not any(observed)
    # the prompt's chunks are cut to 8 slots; then every 4 generated tokens (at tokens 33 and 37)
    assert held[0][0].tolist() == [0, 1, 32, 33, 34, 35, 36, 37, 38, 39]


class DecodeOnly(KeyNorm):
    """Compacts only during decode: ``budgets`` says None for the prompt (no compaction there)."""

    name = "test_decode_only"

    def budgets(self, prompt_len: int, phase: Phase) -> tuple[int, ...] | None:
        return super().budgets(prompt_len, phase) if phase is Phase.DECODE else None


def test_no_prompt_compaction_is_none():
    """None for the prompt phase means: the prompt stays whole; the plan and the schedule follow."""
    method = DecodeOnly(KeyNormConfig(), SHAPE)
    plan = method.memory_plan(30, 10, 8)
    assert plan.resident_tokens == (30, 30)
    assert plan.decode_peak_tokens == (max(30, 12) + 3,) * 2
    lens = []
    _drive(method, _keys(40), 30, chunk=8, num_decode=10, on_step=lambda step, held: lens.append(held[0].shape[1]))
    # the prompt is kept whole; decode evicts back to 12 every 3 generated tokens
    assert lens == [8, 16, 24, 30, 31, 32, 12, 13, 14, 12, 13, 14, 12, 13]


def test_resumed_window_names_only_this_chains_latest_slots():
    """R-KV (prompt never observed) resumed in a chain with a decode eviction inside its observation
    window: ``score()`` sees only queries of the latest slots, and ``query_slots`` names those slots."""
    params = dict(
        sink_keep_tokens=0,
        decode_keep_tokens=6,
        recent_keep_tokens=4,
        rkv_compression_interval=5,
        rkv_observation_tokens=4,
    )
    keys = _keys(40, seed=2)
    for layer_keys in keys:
        layer_keys[..., -1] = torch.arange(40, dtype=layer_keys.dtype)[:, None]  # each key tagged too
    seen = []

    def build():
        method = sm.build_method("rkv", SHAPE, **params)
        score = method.score

        def recording(layer, inputs):
            seen.append((inputs.queries[:, 0, -1].tolist(), inputs.keys[inputs.query_slots, 0, -1].tolist()))
            return score(layer, inputs)

        method.score = recording
        return method

    one = build()
    held = _drive(one, keys, 10, chunk=8, num_decode=8, tagged=True)  # turn 1: evicts at 5 generated
    state = one.release("r")
    seen.clear()
    # turn 2: 3 new prompt tokens (18-20), then generated 21, 22: the chain's 10th token evicts
    _drive(build(), keys, 21, chunk=8, num_decode=2, rid="s", held=held, tagged=True, resumed=state)
    assert len(seen) == SHAPE.num_layers
    for queries, slots in seen:
        assert queries == slots
        assert queries == list(range(23 - len(queries), 23))
