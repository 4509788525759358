"""Prefix-cache pruning with ``kvzip_global`` on the embedded checkpoint (its tokenizer writes the replay
instruction), fp32 on CPU: the kept set is what a plain HF computation of the policy keeps (replays of
each range's chunks after the history up to the last range, softmax over the range's keys, mean over
replay queries, max over heads, layers and chunks, one budget over every range); a budget of every
range token is the identity; ``keep_tokens=0`` drops the ranges; the pruned chain resumes and decodes
as HF does from a cache with only the retained positions."""

from __future__ import annotations

import pytest
import torch
from test_chain_cache_prune import _hf_greedy_from_pruned, _one_thread  # noqa: F401 - the fixture
from tiny_models import DEFAULT_MODEL

from sparse_methods.methods.kvzip import FIRST_INSTRUCTION, INSTRUCTION_END, NEXT_INSTRUCTION
from sparse_serve import LLM, PruneError, SamplingParams

BLOCK = 16
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
HISTORY = torch.randint(10, 4000, (150,), generator=torch.Generator().manual_seed(5)).tolist()  # 9 full blocks
RANGES = [(20, 70), (90, 131)]  # the replays follow the history's first 131 tokens: a partial block is recomputed


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    hf.set_attn_implementation("eager")  # attention probabilities come out of eager attention only
    return hf, AutoTokenizer.from_pretrained(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def llm():
    # A step budget of 48 tokens: the history's tail and a replay run in several scratch chunks.
    llm = LLM(str(DEFAULT_MODEL), device="cpu", dtype="float32", block_size=BLOCK, max_num_batched_tokens=48)
    llm.generate(HISTORY, SamplingParams(max_tokens=1))  # the history's 9 full blocks are cached
    return llm


def _replay(tokenizer, start: int, end: int, hint: int | None) -> list[int]:
    """KVzip's replay of ``HISTORY[start:end]``, each text part tokenized on its own (as the engine does)."""

    def enc(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    chunk = HISTORY[start:end]
    if hint is None:
        return enc(FIRST_INSTRUCTION) + enc(INSTRUCTION_END) + chunk
    return enc(NEXT_INSTRUCTION) + HISTORY[hint:start] + enc(INSTRUCTION_END) + chunk


def _hf_kept(model, tokenizer, ranges, keep: int, chunk: int, prev: int) -> list[list[int]]:
    r_max = ranges[-1][1]
    scores = []
    for lo, hi in ranges:
        best = torch.zeros(hi - lo)
        for s in range(lo, hi, chunk):
            ids = HISTORY[:r_max] + _replay(tokenizer, s, min(s + chunk, hi), None if s == lo else max(lo, s - prev))
            with torch.no_grad():
                att = model(torch.tensor([ids]), output_attentions=True).attentions  # per layer [1, Hq, T, T]
            for a in att:
                p = a[0, :, r_max:, lo:hi]
                p = p / p.sum(-1, keepdim=True)  # the softmax over the range's keys alone
                best = torch.maximum(best, p.mean(1).amax(0))
        scores.append(best)
    positions = torch.cat([torch.arange(lo, hi) for lo, hi in ranges])
    chosen = positions[torch.sort(torch.cat(scores), descending=True, stable=True).indices[:keep]].tolist()
    return [sorted(p for p in chosen if lo <= p < hi) for lo, hi in ranges]


def _retained(kept) -> list[int]:
    outside = [p for p in range(len(HISTORY) // BLOCK * BLOCK) if not any(lo <= p < hi for lo, hi in RANGES)]
    return sorted(outside + [p for k in kept for p in k])


def test_kvzip_global_keeps_what_hf_keeps_and_resumes(llm, model):
    hf, tokenizer = model
    args = dict(policy="kvzip_global", kvzip_score_chunk_size=20, kvzip_prev_postfix_size=6)
    result = llm.prune(HISTORY, RANGES, keep_tokens=30, **args)
    want = _hf_kept(hf, tokenizer, RANGES, 30, 20, 6)
    assert result.kept == tuple(map(tuple, want))
    assert sum(map(len, result.kept)) == 30 and all(result.kept)  # one budget, shared unevenly here
    retained = _retained(result.kept)
    assert result.num_tokens == 144 and result.num_retained_tokens == len(retained) == 144 - 91 + 30

    suffix = HISTORY[144:] + [11, 12, 13]
    out = llm.generate(HISTORY + [11, 12, 13], GREEDY, chain_id=result.chain_id)[0]
    assert out.chain_status == "resumed" and out.reused_tokens == 144
    assert list(out.token_ids) == _hf_greedy_from_pruned(hf, HISTORY[:144], retained, suffix, GREEDY.max_tokens)


def test_kvzip_global_full_budget_is_the_identity_and_zero_drops(llm):
    prompt = HISTORY + [11, 12, 13]
    exact = llm.generate(prompt, GREEDY)[0]
    whole = llm.prune(HISTORY, RANGES, keep_tokens=91, policy="kvzip_global")
    assert whole.kept == tuple(tuple(range(lo, hi)) for lo, hi in RANGES) and whole.num_retained_tokens == 144
    assert llm.generate(prompt, GREEDY, chain_id=whole.chain_id)[0].token_ids == exact.token_ids

    ends = [(20, 70), (90, 128)]  # the last range ends the prompt: kvzip_global needs no token after it
    none = llm.prune(HISTORY[:128], ends, keep_tokens=0, policy="kvzip_global")
    assert none.kept == ((), ()) and none.num_tokens == 128 and none.num_retained_tokens == 128 - 88


def test_kvzip_global_errors(llm, tiny_checkpoint):
    def fails(engine, match, code, param, prompt=HISTORY, **kwargs):
        with pytest.raises(PruneError, match=match) as e:
            engine.prune(prompt, [(20, 70)], keep_tokens=4, policy="kvzip_global", **kwargs)
        assert (e.value.code, e.value.param) == (code, param)

    fails(llm, "replay chunk", "invalid_value", "kvzip_score_chunk_size", kvzip_score_chunk_size=0)
    fails(llm, "replay hint", "invalid_value", "kvzip_prev_postfix_size", kvzip_prev_postfix_size=-1)
    path, _ = tiny_checkpoint("llama")  # no tokenizer: no instruction to replay
    plain = LLM(str(path), device="cpu", dtype="float32", block_size=8)
    fails(plain, "tokenizer", "prune_unsupported", None, prompt=[t % 300 + 3 for t in HISTORY])
