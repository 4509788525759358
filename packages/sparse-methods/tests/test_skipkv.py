"""SkipKV on the eviction base, driven with random tensors: each compaction keeps exactly what a plain
implementation of SE's scoring written here keeps (importance minus token redundancy minus the segment
penalty); when it triggers, the prompt left whole, the identity under a large budget, parameters."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

import sparse_methods as sm

# The tests run in importlib mode with only tests/ on the path: the R-KV tests' driver is loaded by file.
_spec = importlib.util.spec_from_file_location("_tova_rkv_driver", Path(__file__).with_name("test_tova_rkv.py"))
_driver = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_driver)
SCALE, SHAPE, _drive = _driver.SCALE, _driver.SHAPE, _driver._drive

B = dict(sink_keep_tokens=4, decode_keep_tokens=10, recent_keep_tokens=6)  # budget 20


def _periodic_keys(n: int, seed: int) -> list[torch.Tensor]:
    """Per layer ``[n, Hkv, D]``: random, but from token 16 on mostly a noisy copy of the key 8 back (so
    4-token segments repeat and keys have near-copies) and now and then a fresh one."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(SHAPE.num_layers):
        k = torch.randn(n, SHAPE.num_kv_heads, SHAPE.head_dim, generator=g)
        for t in range(16, n):
            if torch.rand((), generator=g) < 0.8:
                k[t] = k[t - 8] + 0.15 * torch.randn(SHAPE.num_kv_heads, SHAPE.head_dim, generator=g)
        out.append(k)
    return out


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.flatten().double(), b.flatten().double()
    return float(a @ b / ((a.norm() + 1e-8) * (b.norm() + 1e-8)))


def _reference(query, keys, *, sink, keep, recent, alpha, window, segment, threshold, penalties=True) -> list[int]:
    """SkipKV's selection as SE describes it, with loops: importance = softmax over the candidates
    [sink, L) of each query head's scaled q.k, max over heads; on the last ``window`` middle tokens minus
    ``alpha`` x token redundancy (cosine of flattened keys, diagonal and entries under 0.8 dropped, each
    row's link to its most recent similar later token dropped, row mean, softmax) and minus the segment
    penalty (a segment's mean key's largest cosine with a later segment's, if >= ``threshold``); keep sink,
    recent and the top ``keep`` of the middle (ties to the earlier token)."""
    num_keys = keys.shape[0]
    g = SHAPE.num_q_heads // SHAPE.num_kv_heads
    importance = [0.0] * num_keys
    for h in range(SHAPE.num_q_heads):
        logits = torch.tensor([float(query[h] @ keys[t, h // g]) * SCALE for t in range(sink, num_keys)])
        for t, p in zip(range(sink, num_keys), torch.softmax(logits, 0).tolist(), strict=True):
            importance[t] = max(importance[t], p)
    end = num_keys - recent
    score = {t: importance[t] for t in range(sink, end)}
    win = list(range(max(sink, end - window), end))
    if penalties and win:
        w = len(win)
        sim = [[0.0] * w for _ in range(w)]
        for i in range(w):
            for j in range(w):
                c = _cos(keys[win[i]], keys[win[j]])
                sim[i][j] = c if i != j and c >= 0.8 else 0.0
            later = [j for j in range(i + 1, w) if sim[i][j] > 0]
            if later:
                sim[i][max(later)] = 0.0
        redundancy = torch.softmax(torch.tensor([sum(row) / w for row in sim]), 0).tolist()
        segments = [win[s : s + segment] for s in range(0, w, segment)]
        means = [keys[seg].mean(0) for seg in segments]
        for s, seg in enumerate(segments):
            best = max((_cos(means[s], means[u]) for u in range(s + 1, len(segments))), default=-math.inf)
            for t in seg:
                score[t] -= alpha * redundancy[win.index(t)] + (best if best >= threshold else 0.0)
    top = sorted(score, key=lambda t: (-score[t], t))[:keep]
    return list(range(sink)) + sorted(top) + list(range(end, num_keys))


@pytest.mark.parametrize(("alpha", "seed"), [(0.1, 0), (3.0, 1), (0.0, 2)])
def test_skipkv_keeps_what_the_plain_scoring_keeps(alpha, seed):
    params = dict(skipkv_compression_interval=5, skipkv_redundancy_window=9, skipkv_segment_size=4)
    params |= dict(skipkv_similarity_threshold=0.9, skipkv_alpha=alpha)
    method = sm.build_method("skipkv", SHAPE, **B, **params)
    checked, differ = [], []

    def check(layer, queries, keys, keep):
        assert torch.equal(keep[0], keep[1])  # one set per layer
        kw = dict(sink=4, keep=10, recent=6, alpha=alpha, window=9, segment=4, threshold=0.9)
        ref = _reference(queries[-1], keys, **kw)
        assert keep[0].tolist() == ref
        differ.append(ref != _reference(queries[-1], keys, **kw, penalties=False))
        checked.append(keys.shape[0])

    held = _drive(method, _periodic_keys(90, seed), 12, 78, chunk=8, on_compaction=check, seed=seed)
    assert checked == [25] * 2 * 14  # from 12 + 13 generated tokens on, every 5: back to 20 at 25
    assert any(differ)  # the penalties changed what is kept
    assert all(h.shape[1] == 20 + (90 - 25) % 5 for h in held)


def test_skipkv_triggers_on_length_and_leaves_the_prompt():
    """The prompt is not compressed; the first decode step of a long prompt compacts at once (its length
    is past the budget plus an interval), then every interval."""
    method = sm.build_method("skipkv", SHAPE, **B, skipkv_compression_interval=5)
    checked = []
    held = _drive(
        method,
        _periodic_keys(60, 3),
        40,
        12,
        chunk=16,
        on_compaction=lambda layer, q, keys, keep: checked.append((keys.shape[0], keep.shape[1])),
    )
    assert checked == [(41, 20)] * 2 + [(25, 20)] * 2 * 2
    assert all(h.shape[1] == 21 for h in held)


def test_budget_above_the_context_is_the_identity():
    method = sm.build_method("skipkv", SHAPE, skipkv_compression_interval=2)
    held = _drive(method, _periodic_keys(80, 4), 50, 30, chunk=16)
    assert all(torch.equal(h, torch.arange(80).expand(SHAPE.num_kv_heads, -1)) for h in held)


def test_chain_state_resumes_like_one_session():
    """A chain's next turn (new prompt, then decoding) from the released state keeps what the session that
    never ended keeps (also when the same state is resumed twice)."""
    params = dict(**B, skipkv_compression_interval=4, skipkv_redundancy_window=8, skipkv_segment_size=4)
    keys = _periodic_keys(110, 5)
    one, session = (sm.build_method("skipkv", SHAPE, **params) for _ in range(2))
    held = _drive(one, keys, 30, 23, chunk=8)
    assert all(torch.equal(a, b) for a, b in zip(_drive(session, keys, 30, 23, chunk=8), held, strict=True))
    state = one.release("r")
    expected = _drive(session, keys, 75, 30, chunk=8, held=held, seed=1)
    for _ in range(2):
        other = sm.build_method("skipkv", SHAPE, **params)
        resumed = _drive(other, keys, 75, 30, chunk=8, rid="s", held=held, seed=1, resumed=state)
        assert all(torch.equal(a, b) for a, b in zip(resumed, expected, strict=True))


def test_parameters():
    c = sm.make_config("skip_kv")
    assert (c.skipkv_compression_interval, c.skipkv_alpha, c.skipkv_similarity_threshold) == (128, 0.1, 0.95)
    assert (c.skipkv_segment_size, c.skipkv_max_redundancy_tokens, c.skipkv_redundancy_window) == (32, 4096, 64)
    assert (c.skipkv_enable_sentence_scoring, c.skipkv_sentence_score_weight) == (True, 1.0)
    assert (c.skipkv_sentence_min_tokens, c.skipkv_sentence_max_tokens) == (4, 256)
    assert (c.skipkv_sentence_embedding_layer, c.skipkv_max_tracked_sentences) == (-1, 256)
    assert (c.sink_keep_tokens, c.decode_keep_tokens, c.recent_keep_tokens) == (64, 4096, 512)
    assert sm.get_method_class("skip-kv") is sm.get_method_class("skipkv")
    assert sm.canonical_method_name("skip-kv") == "skipkv" and "skip-kv" not in sm.method_names()
    assert sm.get_method_class("skipkv").prefix_cache_mode == sm.PrefixCacheMode.CHAIN
    with pytest.raises(ValueError, match="activation steering"):
        sm.make_config("skipkv", skipkv_enable_activation_steering=True)
    with pytest.raises(ValueError, match="skipkv_max_redundancy_tokens"):
        sm.make_config("skipkv", skipkv_redundancy_window=100, skipkv_max_redundancy_tokens=64)
