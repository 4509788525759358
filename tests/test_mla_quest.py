"""Quest on MLA models: page summaries of the latent + rope rows, pages chosen by the absorbed decode
queries, decode reading only the chosen pages through the latent kernel's CSR. A budget above the
context equals dense HF (fp32, CPU) on tiny DeepSeek-V2 and GLM4-MoE-Lite; with a small budget the
blocks' summaries are each page's min / max row, every selecting decode row reads exactly the pages
a plain torch Quest picks from those rows (sink and newest forced), and its output is latent
attention over those pages only."""

from __future__ import annotations

import pytest
import torch
from summary_checks import assert_summarizes
from test_mla_engine import MAX_NEW, _prompts, mla_checkpoint  # noqa: F401
from tiny_models import hf_greedy

from sparse_kernels.summary_codes import decode_summary
from sparse_serve import LLM, SamplingParams
from sparse_serve.latent_paged_attention import LatentPagedAttention

BLOCK = 4
QUEST = dict(sparse_method="quest", quest_chunk_size=BLOCK, block_size=BLOCK, quest_skip_layers=0)


def _llm(path, device: str = "cpu", **params) -> LLM:
    return LLM(str(path), device=device, dtype="float32", **QUEST, **params)


def _greedy(llm: LLM, prompts) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    return [list(o.token_ids) for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("name", ["deepseek_v2", "glm4_moe_lite"])
def test_quest_budget_above_context_equals_dense(mla_checkpoint, name):  # noqa: F811
    path, hf_model = mla_checkpoint(name)
    prompts = _prompts(seed=5)
    expected = [hf_greedy(hf_model, p, MAX_NEW) for p in prompts]
    big = dict(sink_keep_tokens=4, decode_keep_tokens=256, recent_keep_tokens=4)
    assert _greedy(_llm(path, **big), prompts) == expected


def _check_pages(batch, chosen, cache, sink: int, recent: int, tol: float) -> None:
    """Per row, plain torch Quest over the rows themselves: the bound of each page (max over heads of
    ``sum_d max(q_d min_d, q_d max_d)`` from the page's valid rows); the chosen pages are ascending,
    hold the sink and recent pages, and no page left out bounds higher than a chosen one (beyond
    ``tol``, for the GPU's own arithmetic). Also checks the store's summaries hold those min / max (as
    Quest's default int8 codes: rounded outward, bounds from the decoded codes). Quest ranks bfloat16
    bounds: a page left out may bound above a chosen one by their rounding."""
    for b in range(batch.query.shape[0]):
        kv_len = int(batch.kv_lens[b])
        n = -(-kv_len // batch.block_size)
        blocks = batch.table_indices[int(batch.table_start[b]) : int(batch.table_start[b]) + n]
        bounds = []
        for p, block in enumerate(blocks.tolist()):
            valid = min(batch.block_size, kv_len - p * batch.block_size)
            rows = cache[block, :valid]
            scale = None if batch.page_scale is None else batch.page_scale[block]
            assert_summarizes(batch.page_min[block], batch.page_max[block], scale, rows)
            lo, hi = batch.page_min[block, 0].float(), batch.page_max[block, 0].float()
            if scale is not None:  # the bounds the codes stand for
                lo, hi = decode_summary(batch.page_min[block], batch.page_max[block], scale)
                lo, hi = lo[0], hi[0]
            q = batch.query[b].float()
            bounds.append(torch.maximum(q * lo, q * hi).sum(-1).max())
        bounds = torch.stack(bounds)
        pages = chosen[b, 0]
        assert torch.equal(pages, torch.sort(pages).values) and len(set(pages.tolist())) == len(pages) < n
        forced = set(range(sink)) | set(range(n - recent, n))
        assert forced <= set(pages.tolist())
        left_out = torch.ones(n, dtype=torch.bool, device=bounds.device)
        left_out[pages] = False
        middle = [p for p in pages.tolist() if p not in forced]
        top, floor = bounds[left_out].max(), bounds[middle].min()
        assert top.bfloat16() <= floor.bfloat16() or top <= floor + tol  # equal (or below) once rounded


@pytest.mark.parametrize(
    ("device", "chunk"),
    [
        ("cpu", None),
        ("cpu", 8),
        pytest.param(
            "cuda",
            None,
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
        ),
    ],
)
def test_quest_reads_only_the_pages_it_picks(mla_checkpoint, monkeypatch, device, chunk):  # noqa: F811
    """Sink 1 page, keep 2, recent 1 (16 tokens): longer contexts select. Each selecting decode row's
    pages are the plain torch choice over the cached rows, and its attention output equals softmax
    attention over those pages' rows only; the greedy tokens then differ from dense somewhere.
    Decode-only steps select through the batched path (picks written into the plan on the device);
    with 8-token chunks, steps that mix prefill chunks and decodes plan their pages on the host. On
    CUDA the summaries, page bounds and latent attention run as Triton kernels."""
    import sparse_serve.latent_paged_attention as lpa

    path, hf_model = mla_checkpoint("deepseek_v2")
    small = dict(sink_keep_tokens=BLOCK, decode_keep_tokens=2 * BLOCK, recent_keep_tokens=BLOCK)
    llm = _llm(path, device, **small, **({} if chunk is None else {"max_num_batched_tokens": chunk}))
    tol = 0.0 if device == "cpu" else 1e-3
    method = llm.engine.method
    pending: list = []
    checked = {"rows": 0}
    select = method.select_decode

    def spy_select(layer, batch):
        chosen = select(layer, batch)
        cache = llm.engine.runner.kv.latent[layer]
        assert chosen.shape == (batch.query.shape[0], 1, 1 + 2 + 1)  # sink + keep + recent pages
        _check_pages(batch, chosen, cache, 1, 1, tol)
        pending.append((batch, chosen, cache))
        return chosen

    attend = lpa.latent_attention

    def spy_attention(q, cache, plan, out=None):
        out = attend(q, cache, plan, out=out)
        if pending:
            batch, chosen, layer_cache = pending.pop()
            assert layer_cache is cache and not pending
            latent_dim = llm.engine.runner.store.latent_dim
            for b in range(batch.query.shape[0]):
                i = next(i for i in range(q.shape[0]) if torch.equal(q[i], batch.query[b]))
                start, kv_len = int(batch.table_start[b]), int(batch.kv_lens[b])
                blocks = batch.table_indices[start + chosen[b, 0]].tolist()
                last = kv_len - (-(-kv_len // BLOCK) - 1) * BLOCK
                rows = torch.cat([cache[blk, : (last if blk == blocks[-1] else BLOCK), 0] for blk in blocks])
                probs = torch.softmax(batch.sm_scale * q[i].float() @ rows.float().T, dim=-1)
                ref = (probs @ rows[:, :latent_dim].float()).to(out.dtype)
                torch.testing.assert_close(out[i], ref, **({} if device == "cpu" else dict(rtol=1e-3, atol=1e-3)))
                checked["rows"] += 1
        return out

    monkeypatch.setattr(method, "select_decode", spy_select)
    monkeypatch.setattr(lpa, "latent_attention", spy_attention)
    prompts = _prompts(seed=5)
    tokens = _greedy(llm, prompts)
    assert checked["rows"] >= 2 * MAX_NEW  # both layers of the 23- and 40-token prompts' decodes
    assert llm.engine.runner.attention.selective.num_selections > 0  # decode-only steps: the batched path
    assert tokens != [hf_greedy(hf_model, p, MAX_NEW) for p in prompts]


def test_selecting_without_summaries_is_an_error():
    from sparse_methods import ModelShape, build_method

    latent = (torch.zeros(4, BLOCK, 1, 8),)
    quest = build_method("quest", ModelShape(1, 2, 1, 8), quest_chunk_size=BLOCK, quest_skip_layers=0)
    with pytest.raises(ValueError, match="block summaries"):
        LatentPagedAttention(latent, num_heads=2, latent_dim=6, block_size=BLOCK, method=quest)
