"""Block-sparse prefill (FlashPrefill): selection against a plain per-tile loop, attention against the
reference and dense prefill.

Small blocks (16 queries per tile, 16 keys per block) so that short sequences have many tiles and
blocks; the Triton kernels run natively on CUDA where present, else under Triton's interpreter.
"""

from __future__ import annotations

import math

import pytest
import torch

from sparse_kernels import BatchPrefillWithPagedKVCache
from sparse_kernels.block_sparse_prefill import (
    BatchBlockSparsePrefillWithPagedKVCache,
    block_sparse_attention_reference,
)
from sparse_kernels.prefill_block_selection import BlockSparseParams

NUM_KV_HEADS = 2
TOL = {torch.float32: {"atol": 2e-5, "rtol": 2e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}
# Request 0 prefills from scratch, 1 has a cached prefix, 2 is short (dense), 3 ends mid-block.
QO_LENS, KV_LENS = [70, 37, 5, 45], [70, 100, 40, 61]


def _params(threshold: float, **kw) -> BlockSparseParams:
    base = dict(k_block_m=16, k_block_n=16, attention_sink_blocks=1, window_blocks=1, last_query_blocks=1)
    return BlockSparseParams(threshold, **{**base, "min_sparse_q_len": 8, **kw})


def _batch(paged_batch, device, *, group=2, head_dim=32, dtype=torch.float32, seed=0, qo=QO_LENS, kv=KV_LENS):
    return paged_batch(
        qo, kv, block_size=4, num_qo_heads=group * NUM_KV_HEADS, num_kv_heads=NUM_KV_HEADS,
        head_dim=head_dim, dtype=dtype, seed=seed,
    ).to(device)  # fmt: skip


def _wrapper(batch, params, device="cpu", backend="reference"):
    wrapper = BatchBlockSparsePrefillWithPagedKVCache(device, params=params, backend=backend)
    batch.plan_prefill(wrapper)
    return wrapper


def _plain_selection(batch, params: BlockSparseParams) -> dict[tuple[int, int, int], tuple[set, set]]:
    """(request, KV head, tile) -> (kept blocks, mean-corrected blocks), straight from the definition."""
    p, q = params, batch.q.cpu().double()
    g = q.shape[1] // NUM_KV_HEADS
    scale = q.shape[-1] ** -0.5 * math.log2(math.e)
    result = {}
    for b, k in enumerate(batch.k_seqs):
        start, q_len, kv_len = int(batch.qo_indptr[b]), int(batch.qo_indptr[b + 1] - batch.qo_indptr[b]), k.shape[0]
        prefix, nb, n_t = kv_len - q_len, -(-kv_len // p.k_block_n), -(-q_len * g // p.k_block_m)
        means = [k[j * p.k_block_n : (j + 1) * p.k_block_n].double().mean(0) for j in range(nb)]
        for h in range(NUM_KV_HEADS):
            for m in range(n_t):
                rows = range(m * p.k_block_m, min((m + 1) * p.k_block_m, q_len * g))
                q_first, q_last = rows[0] // g, rows[-1] // g
                first_k, last_k = (prefix + q_first) // p.k_block_n, (prefix + q_last) // p.k_block_n
                visible = {j for j in range(nb) if j <= last_k}
                if q_len <= p.min_sparse_q_len or m >= n_t - p.last_query_blocks:
                    result[b, h, m] = (visible, set())
                    continue
                active = (prefix + q_last + 1) // p.k_block_n
                logits = {}
                for r in rows:
                    qr = q[start + r // g, h * g + r % g]
                    for j in range(active):
                        if prefix + r // g >= j * p.k_block_n:
                            logits[r, j] = float(qr @ means[j][h]) * scale
                top = max(logits.values(), default=0.0)  # no block scored: only sink and window blocks
                mass = [sum(2 ** (s - top) for (_, jj), s in logits.items() if jj == j) for j in range(active)]
                scored = {j for j in range(active) if mass[j] >= p.abs_threshold * max(mass)}
                window = set(range(first_k - p.window_blocks + 1, last_k + 1))
                kept = {j for j in visible if j in scored or j < p.attention_sink_blocks or j in window}
                mean_end = min(nb, (prefix + q_first) // p.k_block_n) if p.use_mean_correction else 0
                result[b, h, m] = (kept, {j for j in range(mean_end) if j not in kept})
    return result


def _lists_as_sets(lists, layout) -> dict[tuple[int, int, int], tuple[set, set]]:
    out = {}
    for b in range(len(layout.qo_lens)):
        for t in range(layout.tile_starts[b], layout.tile_starts[b + 1]):
            for h in range(layout.num_kv_heads):
                kept = lists.keep_ids[h, t, : lists.keep_counts[h, t]].tolist()
                mean = lists.mean_ids[h, t, : lists.mean_counts[h, t]].tolist()
                assert kept == sorted(set(kept)) and mean == sorted(set(mean))  # ascending, no repeats
                out[b, h, t - layout.tile_starts[b]] = (set(kept), set(mean))
    return out


@pytest.mark.parametrize(
    "backend, threshold, group",
    [("reference", t, g) for t in (0.0, 0.05, 0.3, 1.0) for g in (1, 3)] + [("triton", 0.05, 3), ("triton", 1.0, 1)],
)
def test_selection_equals_plain_per_tile_loop(paged_batch, triton_device, backend, threshold, group):
    device = triton_device if backend == "triton" else "cpu"
    batch = _batch(paged_batch, "cpu", group=group, seed=int(threshold * 100) + group)
    params = _params(threshold, attention_sink_blocks=1, window_blocks=2)
    expected = _plain_selection(batch, params)
    wrapper = _wrapper(batch.to(device), params, device, backend)
    k_mean, v_mean, lists = wrapper.select(batch.q, batch.k_cache, batch.v_cache)
    assert _lists_as_sets(lists, wrapper.layout) == expected
    for b in range(len(batch.k_seqs)):  # block means of the sparse requests (zeros for the dense one)
        for mean, seq in ((k_mean, batch.k_seqs[b]), (v_mean, batch.v_seqs[b])):
            for j in range(wrapper.layout.max_blocks):
                block = seq[16 * j : 16 * (j + 1)]
                truth = block.mean(0) if wrapper.layout.sparse[b] and len(block) else torch.zeros_like(seq[0])
                torch.testing.assert_close(mean[b, j].cpu(), truth, atol=1e-6, rtol=1e-6)


def test_selection_drops_blocks_at_positive_thresholds(paged_batch):
    batch = _batch(paged_batch, "cpu", qo=[200], kv=[300])
    batch.q *= 8  # peaked scores (random keys' block means are small)
    kept = {}
    for threshold in (0.0, 0.2, 1.0):
        _, _, lists = _wrapper(batch, _params(threshold)).select(batch.q, batch.k_cache, batch.v_cache)
        kept[threshold] = int(lists.keep_counts.sum())
    assert kept[0.0] > kept[0.2] > kept[1.0]


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("mean_correction", [True, False])
def test_threshold_zero_equals_dense_prefill(paged_batch, triton_device, backend, mean_correction):
    device = triton_device if backend == "triton" else "cpu"
    batch = _batch(paged_batch, device, group=2)
    wrapper = _wrapper(batch, _params(0.0, use_mean_correction=mean_correction), device, backend)
    assert wrapper.layout is not None
    dense = BatchPrefillWithPagedKVCache(device, backend="reference")
    batch.plan_prefill(dense)
    out = wrapper.run(batch.q, batch.k_cache, batch.v_cache)
    torch.testing.assert_close(out, dense.run(batch.q, batch.k_cache, batch.v_cache), **TOL[torch.float32])
    torch.testing.assert_close(out.cpu(), batch.reference(), **TOL[torch.float32])


@pytest.mark.parametrize(
    "threshold, mean_correction, group, dtype",
    [(0.1, True, 2, torch.float32), (0.4, False, 1, torch.float32), (0.25, True, 4, torch.bfloat16)],
)
def test_triton_equals_reference(paged_batch, triton_device, threshold, mean_correction, group, dtype):
    batch = _batch(paged_batch, "cpu", group=group, dtype=dtype, seed=3)
    batch.q *= 20  # peaked scores, so that blocks are dropped
    params = _params(threshold, use_mean_correction=mean_correction)
    reference = _wrapper(batch, params)
    k_ref, v_ref, lists_ref = reference.select(batch.q, batch.k_cache, batch.v_cache)
    all_blocks = _wrapper(batch, _params(0.0)).select(batch.q, batch.k_cache, batch.v_cache)[2]
    assert int(lists_ref.keep_counts.sum()) < int(all_blocks.keep_counts.sum())
    expected = reference.run(batch.q, batch.k_cache, batch.v_cache)
    batch.to(triton_device)
    wrapper = _wrapper(batch, params, triton_device, "triton")
    k_mean, v_mean, lists = wrapper.select(batch.q, batch.k_cache, batch.v_cache)
    torch.testing.assert_close(k_mean.cpu(), k_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v_mean.cpu(), v_ref, atol=1e-5, rtol=1e-5)
    assert _lists_as_sets(lists, wrapper.layout) == _lists_as_sets(lists_ref, reference.layout)
    out = torch.full_like(batch.q, float("nan"))
    assert wrapper.run(batch.q, batch.k_cache, batch.v_cache, out=out) is out
    torch.testing.assert_close(out.cpu(), expected, **TOL[dtype])


def test_triton_reads_a_block_in_several_key_steps(paged_batch, triton_device, monkeypatch):
    """Blocks of 64 keys read in 16-key steps (4 per kept block), GQA group 3 splitting positions across
    tiles of 32 rows: the kernel's list walk and diagonal against the reference on the same selection."""
    from sparse_kernels._triton import block_sparse_prefill as kernel

    monkeypatch.setitem(kernel.BLOCK_SPARSE_PREFILL_CONFIG, "BLOCK_N", 16)
    batch = _batch(paged_batch, "cpu", group=3, seed=11, qo=[150, 90], kv=[330, 90])
    batch.q *= 20
    params = _params(0.2, k_block_m=32, k_block_n=64, window_blocks=1, last_query_blocks=2)
    reference = _wrapper(batch, params)
    lists = reference.select(batch.q, batch.k_cache, batch.v_cache)[2]
    expected = reference.run(batch.q, batch.k_cache, batch.v_cache)
    batch.to(triton_device)
    wrapper = _wrapper(batch, params, triton_device, "triton")
    assert _lists_as_sets(wrapper.select(batch.q, batch.k_cache, batch.v_cache)[2], wrapper.layout) == _lists_as_sets(
        lists, reference.layout
    )
    assert int(lists.mean_counts.sum()) > 0
    torch.testing.assert_close(wrapper.run(batch.q, batch.k_cache, batch.v_cache).cpu(), expected, **TOL[torch.float32])


def test_mean_correction_is_exact_for_constant_blocks(paged_batch):
    """Where every key and value of a block is the same, its pooled term equals the block's exact sum:
    any threshold then gives dense attention."""
    batch = _batch(paged_batch, "cpu", seed=5)
    for flat_seq, cache in ((batch.k_seqs, batch.k_cache), (batch.v_seqs, batch.v_cache)):
        for b, seq in enumerate(flat_seq):
            seq.copy_(seq[::16].repeat_interleave(16, 0)[: seq.shape[0]])
            blocks = batch.kv_indices[int(batch.kv_indptr[b]) : int(batch.kv_indptr[b + 1])].long()
            pos = torch.arange(seq.shape[0])
            cache.view(-1, NUM_KV_HEADS, seq.shape[-1])[blocks[pos // 4] * 4 + pos % 4] = seq
    wrapper = _wrapper(batch, _params(1.0))
    assert int(wrapper.select(batch.q, batch.k_cache, batch.v_cache)[2].mean_counts.sum()) > 0
    out = wrapper.run(batch.q, batch.k_cache, batch.v_cache)
    torch.testing.assert_close(out, batch.reference(), **TOL[torch.float32])


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_short_queries_run_dense(paged_batch, triton_device, backend):
    device = triton_device if backend == "triton" else "cpu"
    batch = _batch(paged_batch, device)
    wrapper = _wrapper(batch, _params(1.0, min_sparse_q_len=70), device, backend)  # 70 is the longest chunk
    assert wrapper.layout is None
    dense = BatchPrefillWithPagedKVCache(device, backend=backend)
    batch.plan_prefill(dense)
    assert torch.equal(
        wrapper.run(batch.q, batch.k_cache, batch.v_cache), dense.run(batch.q, batch.k_cache, batch.v_cache)
    )
    with pytest.raises(RuntimeError, match="dense"):
        wrapper.select(batch.q, batch.k_cache, batch.v_cache)


def test_params_and_plan_are_validated(paged_batch):
    for bad, field in (
        (dict(abs_threshold=1.5), "abs_threshold"),
        (dict(k_block_m=24), "k_block_m"),
        (dict(k_block_n=48), "k_block_n"),
        (dict(window_blocks=0), "window_blocks"),
        (dict(attention_sink_blocks=-1), "attention_sink_blocks"),
    ):
        with pytest.raises(ValueError, match=field):
            BlockSparseParams(**{"abs_threshold": 0.1, **bad})
    batch = _batch(paged_batch, "cpu")
    with pytest.raises(ValueError, match="causal"):
        batch.plan_prefill(BatchBlockSparsePrefillWithPagedKVCache(params=_params(0.1)), causal=False)
    with pytest.raises(RuntimeError, match="plan"):
        BatchBlockSparsePrefillWithPagedKVCache(params=_params(0.1)).run(batch.q, batch.k_cache, batch.v_cache)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("threshold", [0.0, 0.01])
def test_triton_equals_reference_at_8k_on_gpu(paged_batch, threshold):
    """SE's block sizes (128 x 128) over a 2048-query chunk at the end of 8K keys, bf16, head_dim 128."""
    batch = paged_batch([2048, 700], [8192, 3000], block_size=16, num_qo_heads=8, num_kv_heads=2, head_dim=128,
                        dtype=torch.bfloat16, seed=7).to("cuda")  # fmt: skip
    params = BlockSparseParams(threshold, min_sparse_q_len=512)
    wrapper = _wrapper(batch, params, "cuda", "triton")
    out = wrapper.run(batch.q, batch.k_cache, batch.v_cache)
    k_mean, v_mean, lists = wrapper.select(batch.q, batch.k_cache, batch.v_cache)  # the same selection
    expected = block_sparse_attention_reference(
        batch.q, batch.k_cache, batch.v_cache, wrapper.layout, lists, k_mean, v_mean, wrapper._plan,
        torch.empty_like(batch.q),
    )  # fmt: skip
    torch.testing.assert_close(out, expected, **TOL[torch.bfloat16])
    if threshold == 0:
        torch.testing.assert_close(out.cpu(), batch.reference(), **TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_selection_matches_torch_selection_at_8k_on_gpu(paged_batch):
    """The fused selection (tf32 scores) against the plain torch selection over the same block means: the
    same (tile, head, block) decisions but for blocks within rounding of the threshold."""
    from sparse_kernels.prefill_block_selection import select_blocks

    batch = paged_batch([2048, 700], [8192, 3000], block_size=16, num_qo_heads=8, num_kv_heads=2, head_dim=128,
                        dtype=torch.bfloat16, seed=9).to("cuda")  # fmt: skip
    batch.q *= 60  # peaked scores: blocks are dropped
    wrapper = _wrapper(batch, BlockSparseParams(0.01, min_sparse_q_len=512), "cuda", "triton")
    k_mean, _, lists = wrapper.select(batch.q, batch.k_cache, batch.v_cache)
    expected = select_blocks(batch.q, k_mean, wrapper.layout, wrapper._plan.sm_scale)
    got, want = _lists_as_sets(lists, wrapper.layout), _lists_as_sets(expected, wrapper.layout)
    assert got.keys() == want.keys()
    kept, dropped = (sum(len(entry[i]) for entry in want.values()) for i in (0, 1))
    assert kept > 0 and dropped > 0
    for i in (0, 1):  # kept, mean-corrected
        assert sum(len(got[key][i] ^ want[key][i]) for key in want) <= 0.01 * kept
