"""Metamorphic property: greedy output does not depend on how the engine batches, pages or caches."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import DEFAULT_MODEL

from sparse_serve import LLM, SamplingParams

PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
_rng = random.Random(0)
# Prompts share a prefix in pairs, so prefix-cache hits happen whenever caching is on.
_BASE = [_rng.randrange(3, 4000) for _ in range(40)]
PROMPTS = [_BASE[:n] + [_rng.randrange(3, 4000) for _ in range(m)] for n, m in [(40, 3), (40, 9), (7, 1), (0, 30)]]
_reference: list[tuple[int, ...]] = []


def _run(**config) -> list[tuple[int, ...]]:
    llm = LLM(str(DEFAULT_MODEL), device="cpu", max_model_len=128, **config)
    outs = llm.generate(PROMPTS, PARAMS)
    assert llm.engine.kv.pool.num_used_blocks == 0
    return [o.token_ids for o in outs]


def reference() -> list[tuple[int, ...]]:
    if not _reference:
        _reference.extend(_run(block_size=16, enable_prefix_caching=False))
    return _reference


@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.sampled_from([1, 2, 3, 8, 16, 32]),
    max_num_batched_tokens=st.integers(1, 64),
    max_num_seqs=st.integers(1, 4),
    extra_blocks=st.integers(0, 40),
    enable_prefix_caching=st.booleans(),
)
def test_greedy_output_is_invariant_to_engine_settings(
    block_size, max_num_batched_tokens, max_num_seqs, extra_blocks, enable_prefix_caching
):
    # The smallest pool that still holds one full-length request, plus some slack: small pools preempt.
    num_kv_blocks = -(-128 // block_size) + extra_blocks
    got = _run(
        block_size=block_size,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        num_kv_blocks=num_kv_blocks,
        enable_prefix_caching=enable_prefix_caching,
    )
    assert got == reference()
